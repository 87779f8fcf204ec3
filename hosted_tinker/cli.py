"""`hosted-tinker` command line: `serve` runs the server; `export` / `import` move checkpoints out and in;
`pool-node` runs another machine's ranks of a worker pool."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Callable

from .checkpoints.paths import KINDS, SCHEME
from .config.settings import ServerConfig
from .config.sources import SettingsError

log = logging.getLogger("hosted_tinker")


def _fail(command: str, problems: list[str]) -> int:
    for line in problems:
        print(f"hosted-tinker {command}: error: {line}", file=sys.stderr)
    return 2


def _serve(config: ServerConfig) -> int:
    from .observability.logs import configure_logging
    from .runtime.cpu_threads import apply_threads, choose_threads, threads_in_environment
    from .server.startup import StartupError, preflight

    configure_logging(config.log_level, config.log_format)
    for line in config.deprecations:
        log.warning("%s", line)
    # a worker pool gives each rank cores / N (served_models.py)
    threads = choose_threads(config.cpu_threads) if config.workers * config.nnodes == 1 else None
    with threads_in_environment(threads) if threads is not None else contextlib.nullcontext():
        try:  # before anything slow (the model loads only once all of this passed; a refusal never loads torch)
            checked = preflight(config)
        except StartupError as e:
            return _fail("serve", e.problems)
        if threads is not None:  # torch loads (if no check loaded it) with the count in the environment
            apply_threads(threads.threads)
            config = config.model_copy(update={"cpu_threads": str(threads.threads)})
    for name, source in checked.model_sources.items():
        log.info("base model %s will be loaded from %s", name, source)
    if threads is not None:
        log.info("CPU threads: %s", threads.why)
    config = config.model_copy(update={"port": checked.port, "vllm_python": checked.vllm_python})

    import uvicorn

    from .api.app import create_app
    from .api.http_protocol import HttpProtocol
    from .api.metrics import Metrics
    from .store.data_dir_lock import DataDirInUse
    from .server.core import Server
    from .runtime.pool_launch import PoolUnavailable
    from .store.database import StoreUnavailable
    from .models.vision import MissingPackage

    metrics = Metrics()
    try:
        srv = Server(config, observer=metrics)  # the data-dir lock first, then the store, then the model load
    except (DataDirInUse, StoreUnavailable, MissingPackage, PoolUnavailable) as e:
        checked.sock.close()
        code = _fail("serve", [str(e)])
        if isinstance(e, PoolUnavailable):
            # A group join that timed out can still be blocked inside torch.distributed's C++ on its
            # daemon thread (pool_launch.GroupJoin); finalizing the interpreter under it aborts the
            # process ("terminate called without an active exception", exit -6) after the one line.
            # This machine's ranks were already stopped; nothing else is left to close.
            logging.shutdown()
            sys.stderr.flush()
            os._exit(code)
        return code
    # Our own access log (api/access_log.py) carries request ids; uvicorn's would duplicate it. log_config=None:
    # uvicorn's records go through the handler configure_logging set up, in the same format.
    server = uvicorn.Server(uvicorn.Config(create_app(config, srv, metrics), http=HttpProtocol, log_config=None,
                                           log_level=config.log_level, timeout_graceful_shutdown=60,
                                           access_log=False))
    server.run(sockets=[checked.sock])
    return 0


class _ProgressBar:
    """A byte progress bar on stderr (tqdm) for export / import; silent when stderr is not a terminal."""

    def __init__(self, label: str):
        self.label = label
        self.bar = None

    def __call__(self, done: int, total: int | None) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(desc=self.label, total=total, unit="B", unit_scale=True, unit_divisor=1024,
                            file=sys.stderr, disable=None)  # None: off when not a terminal
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _export(args: argparse.Namespace) -> int:
    from .checkpoints.export import export_checkpoint
    from .observability.logs import configure_logging

    configure_logging("info", "text")  # --merged loads the base model: its stages are logged
    return _with_progress("export", "checkpoint", lambda bar: export_checkpoint(
        args.tinker_path, args.out, data_dir=args.data_dir, base_url=args.base_url, api_key=args.api_key,
        merged=args.merged, base_model=args.base_model, dtype=args.dtype, force=args.force, progress=bar))


def _import(args: argparse.Namespace) -> int:
    from .checkpoints.export import import_adapter

    return _with_progress("import", "upload", lambda bar: import_adapter(
        args.adapter_dir, name=args.name, base_url=args.base_url, api_key=args.api_key,
        training_run_id=args.run_id, overwrite=args.overwrite, progress=bar)["tinker_path"])


def _with_progress(command: str, label: str, work: Callable[[_ProgressBar], str]) -> int:
    """Runs `work` beside a progress bar and prints what it answers; an ExportError is the
    user's (a message on stderr, exit status 1). The bar is closed before anything is printed."""
    from .checkpoints.export import ExportError

    bar = _ProgressBar(label)
    try:
        out = work(bar)
    except ExportError as e:
        bar.close()
        print(f"hosted-tinker {command}: {e}", file=sys.stderr)
        return 1
    bar.close()
    print(out)
    return 0


def _rotate_token_key(args: argparse.Namespace) -> int:
    from .accounts.tokens import rotate_token_key

    if not args.data_dir.is_dir():
        print(f"hosted-tinker rotate-token-key: {args.data_dir} is not a directory: give the server's --data-dir",
              file=sys.stderr)
        return 1
    path = rotate_token_key(args.data_dir)
    print(f"new token signing key in {path}: every token issued before now is refused (the SDK exchanges its "
          "API key for a new one by itself)")
    return 0


def _pool_node(args: argparse.Namespace) -> int:
    from .observability.logs import configure_logging
    from .runtime.pool_launch import PoolUnavailable
    from .runtime.pool_node import NodeArgs, run_node

    configure_logging("info", "text")
    try:
        run_node(NodeArgs(**{k: v for k, v in vars(args).items() if k not in ("command", "func")}))
    except PoolUnavailable as e:
        return _fail("pool-node", [str(e)])
    return 0  # not reached: run_node becomes torchrun


def _command(sub, name: str, run: Callable[[argparse.Namespace], int], **texts: str) -> argparse.ArgumentParser:
    """Subcommand `name`, which `run` runs with the parsed arguments; `texts`: its help and description."""
    parser = sub.add_parser(name, **texts)
    parser.set_defaults(func=run)
    return parser


def _add_pool_node(sub) -> None:
    p = _command(
        sub, "pool-node", _pool_node,
        help="run this machine's ranks of a worker pool whose server runs on another machine",
        description="Run this machine's ranks of a hosted-tinker worker pool (docs/scale.md): torchrun starts one per "
                    "device and starts each again when it exits. The server (rank 0) runs on machine 0: hosted-tinker "
                    "serve --workers N --nnodes M --master-addr A --master-port P; this command waits for it.")
    p.add_argument("--nnodes", type=int, required=True, help="machines in the pool (the server's --nnodes)")
    p.add_argument("--node-rank", type=int, required=True, help="this machine: 1 .. nnodes-1 (0 is the server's)")
    p.add_argument("--master-addr", required=True, help="the server's --master-addr (its rendezvous store)")
    p.add_argument("--master-port", type=int, required=True, help="the server's --master-port")
    p.add_argument("--workers", type=int, required=True, help="ranks on this machine, one per device (the server's "
                                                               "--workers)")
    p.add_argument("--data-dir", type=Path, default=Path("./data"),
                   help="where this machine builds or finds the base model (default ./data)")
    p.add_argument("--max-restarts", type=int, default=1000, help="how often torchrun restarts this machine's ranks")
    p.add_argument("--pool-interface", help="the network interface this machine's ranks bind and advertise (sets "
                                            "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME); default: the server's "
                                            "--pool-interface")


def _add_remote(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", help="server URL (default: $TINKER_BASE_URL)")
    p.add_argument("--api-key", help="API key (default: $TINKER_API_KEY)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hosted-tinker", description="Self-hosted server for the Tinker training API")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the server",
                           description="Run the server. Every setting is also read from $HOSTED_TINKER_<NAME> "
                                       "(e.g. HOSTED_TINKER_PORT=8001) and from --config FILE (YAML or TOML); "
                                       "flags win over variables, variables over the file.")
    settings_source = ServerConfig.cli_source(serve)

    export = _command(
        sub, "export", _export, help="write a checkpoint as an adapter directory (or a merged model) without the SDK",
        description=f"Export {SCHEME}RUN/KIND/NAME from a running server (--base-url, --api-key) or from a "
                    "server's data directory (--data-dir) as an adapter directory (Tinker's layout, which "
                    "tinker_cookbook.weights reads; a PEFT adapter for text models without MoE experts), or "
                    "with --merged as a full model with every LoRA weight merged in as the server applies it "
                    "(safetensors).")
    export.add_argument("tinker_path", help=f"{SCHEME}<run>/<{'|'.join(KINDS)}>/<name>")
    export.add_argument("--out", type=Path, required=True, help="output directory (created; must be empty)")
    export.add_argument("--merged", action="store_true", help="save the base model with the adapter merged in")
    export.add_argument("--data-dir", type=Path, help="read a server's data directory instead of asking a server")
    _add_remote(export)
    export.add_argument("--base-model", help="with --merged: base model id or path (default: the checkpoint's)")
    export.add_argument("--dtype", default="float32", help="with --merged: float32, bfloat16 or float16")
    export.add_argument("--force", action="store_true", help="replace the contents of a non-empty --out")

    imp = _command(
        sub, "import", _import, help="upload a PEFT adapter directory to a running server as a loadable checkpoint",
        description="Upload an adapter directory (adapter_config.json + adapter_model.safetensors, e.g. from "
                    "peft's save_pretrained or from `hosted-tinker export`). Prints its tinker:// path, for "
                    "ServiceClient.create_training_client_from_state.")
    imp.add_argument("adapter_dir", type=Path)
    imp.add_argument("--name", required=True, help="checkpoint name (letters, digits, '.', '_', '-')")
    imp.add_argument("--run-id", help="put it in this existing training run of yours; default: a new run with a fresh id")
    imp.add_argument("--overwrite", action="store_true", help="replace a checkpoint of the same name")
    _add_remote(imp)

    rotate = _command(
        sub, "rotate-token-key", _rotate_token_key,
        help="replace the key that signs the SDK's JWTs (every token issued before is refused)",
        description="Write a new JWT signing key into the server's data directory (DATA_DIR/jwt_signing.key). A "
                    "running server uses it from its next request on: tokens issued before are refused with 401 "
                    "invalid_token, and SDK clients exchange their API key for a new token by themselves.")
    rotate.add_argument("--data-dir", type=Path, default=Path("./data"), help="the server's --data-dir (default ./data)")
    _add_pool_node(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        try:
            config = ServerConfig.from_cli(settings_source, args)
        except SettingsError as e:
            return _fail("serve", e.problems)
        return _serve(config)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
