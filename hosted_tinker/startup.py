"""Start-up checks that need the outside world, and the summary printed once the server is up.

`hosted-tinker serve` runs, in this order, each step only if the ones before passed:

1. settings (config.py: types, ranges, choices);
2. `preflight`: the device exists, vLLM's settings can work (its Python has vLLM, its devices
   exist and are not training's), the keys file parses, the data directory can be written, the
   port is bound (the bound socket is handed to uvicorn, so nothing can take it meanwhile), the
   model can be found (local directory, Hugging Face cache, or a hub that answers);
3. `Server` (server.py): data-directory lock, store, then the model load, the slow part.

A failed check is one line saying what is wrong and what to do (`StartupError`), never a traceback.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from . import __version__
from .auth import ENV_VAR, KeyConfigError, KeyRing
from .config import ServerConfig, flag
from .model_loading import ModelUnavailable, check_model_available
from .sampling.vllm_sidecar import VLLM_LORA_RANKS

# Where tools/install_vllm_cpu.sh puts vLLM's virtualenv (run from the repository root, as launch.sh is).
DEFAULT_VLLM_PYTHON = Path(".venv-vllm/bin/python")


class StartupError(RuntimeError):
    """A setting that cannot work on this machine; the message is one line with the fix."""


@dataclass
class Preflight:
    sock: socket.socket  # bound, not yet listening: uvicorn listens on it
    port: int  # the bound port (differs from the setting when that is 0)
    model_source: str  # where the model will come from, for the log
    vllm_python: Path | None  # with --vllm: the interpreter that launches it (the default resolved)


def preflight(config: ServerConfig) -> Preflight:
    _check_device(config.device)
    python = _check_vllm(config) if config.vllm else None
    _check_keys(config.api_keys_file)
    _check_data_dir(Path(config.data_dir))
    sock = bind_port(config.host, config.port)
    try:
        source = check_model_available(config.base_model)
    except ModelUnavailable as e:
        sock.close()
        raise StartupError(str(e)) from None
    return Preflight(sock=sock, port=sock.getsockname()[1], model_source=source, vllm_python=python)


def _check_device(spec: str) -> None:
    kind = spec.split(":")[0]
    if kind in ("auto", "cpu"):
        return
    import torch

    backend = getattr(torch, kind, None)
    if backend is None or not backend.is_available():
        raise StartupError(f"{flag('device')} {spec}: no {kind} device is available to torch on this machine; "
                           f"use {flag('device')} cpu (or auto)")
    index = int(spec.split(":")[1]) if ":" in spec else 0
    if index >= backend.device_count():
        raise StartupError(f"{flag('device')} {spec}: this machine has {backend.device_count()} {kind} device(s), "
                           f"numbered from 0")


def vllm_python(config: ServerConfig) -> Path:
    """The interpreter that launches vLLM: --vllm-python, else the default virtualenv's."""
    return config.vllm_python or DEFAULT_VLLM_PYTHON


def _check_vllm(config: ServerConfig) -> Path:
    """--vllm: it can hold our LoRA rank, its devices are not training's, and its Python has vLLM."""
    if config.max_lora_rank > VLLM_LORA_RANKS[-1]:
        raise StartupError(f"{flag('max_lora_rank')} {config.max_lora_rank}: vLLM serves LoRA ranks up to "
                           f"{VLLM_LORA_RANKS[-1]}; lower it to sample on vLLM")
    _check_vllm_devices(config)
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


def _check_vllm_devices(config: ServerConfig) -> None:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    training = config.device
    if training == "auto":
        training = "cuda" if count else "cpu"
    training_gpu = None if not training.startswith("cuda") else int(training.partition(":")[2] or 0)
    if config.vllm_devices is None:
        if training_gpu is not None:
            raise StartupError(f"{flag('vllm')}: give vLLM GPUs of its own with {flag('vllm_devices')} (e.g. "
                               f"{flag('vllm_devices')} {1 if training_gpu == 0 else 0}): training runs on "
                               f"cuda:{training_gpu}")
        return
    devices = [int(d) for d in config.vllm_devices.split(",")]
    where = f"{flag('vllm_devices')} {config.vllm_devices}"
    if not count:
        raise StartupError(f"{where}: no CUDA device is available on this machine; leave {flag('vllm_devices')} unset "
                           "(vLLM's CPU build runs on the CPU)")
    if max(devices) >= count:
        raise StartupError(f"{where}: this machine has {count} CUDA device(s), numbered from 0")
    if training_gpu in devices:
        raise StartupError(f"{where}: includes training's device cuda:{training_gpu} ({flag('device')}); give vLLM "
                           "other devices")


def vllm_child_devices(spec: str | None, parent_visible: str | None) -> str | None:
    """CUDA_VISIBLE_DEVICES for vLLM: --vllm-devices numbers devices as this process sees them, so
    through this process's own CUDA_VISIBLE_DEVICES when it has one."""
    if spec is None or parent_visible is None:
        return spec
    visible = [d.strip() for d in parent_visible.split(",")]
    return ",".join(visible[int(d)] for d in spec.split(","))


def _check_keys(keys_file: Path | None) -> None:
    try:
        KeyRing.load(keys_file)
    except OSError as e:
        raise StartupError(f"{flag('api_keys_file')} {keys_file}: cannot read it ({e.strerror})") from None
    except KeyConfigError as e:  # it names the entry, in the environment or the file
        raise StartupError(str(e) if e.in_env else f"{flag('api_keys_file')}: {e}") from None


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
    sock = socket.socket(family, socket.SOCK_STREAM)
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
    if config.vllm_url is not None:
        return f"vLLM at {config.vllm_url} (attached); the built-in engine for what vLLM refuses"
    if config.vllm:
        devices = f"CUDA devices {config.vllm_devices}" if config.vllm_devices else "its default device"
        return (f"vLLM launched with {vllm_python(config)} on {devices} (log: {Path(config.data_dir) / 'vllm.log'}); "
                "the built-in engine for what vLLM refuses")
    return "the built-in engine, on the training model"


def summary_lines(server, config: ServerConfig, url: str) -> list[str]:
    """What an operator needs to know once the server is up (also what it accepts from whom)."""
    data_dir = Path(config.data_dir).resolve()
    runtime = server.runtime
    dtype = str(next(runtime.model.parameters()).dtype).removeprefix("torch.")
    params = sum(p.numel() for p in runtime.model.parameters())
    if server.keyring.dev_mode:
        auth = f"DEV MODE: any key starting with 'tml-' is accepted (set ${ENV_VAR} or {flag('api_keys_file')})"
    else:
        auth = f"{len(server.keyring)} API key(s); each key sees only its own runs, checkpoints and sessions"
    c = config
    listening = "" if url.endswith(f"//{c.host}:{c.port}") else f" (listening on {c.host}:{c.port})"
    return [
        f"hosted-tinker {__version__} ready at {url}{listening}",
        f"  SDK        tinker.ServiceClient(base_url=\"{url}\"); OpenAI API {url}/v1; dashboard {url}/dashboard",
        f"  data dir   {data_dir}",
        f"  database   {server.store.path.resolve()}",
        f"  model      {c.base_model} on {runtime.device} ({dtype}, {params / 1e6:.1f}M parameters, "
        f"context {runtime.max_context})",
        f"  sampling   {_sampling_line(config)}",
        f"  tokenizer  export HF_ENDPOINT={url} and tc.get_tokenizer() fetches it from this server",
        f"  auth       {auth}",
        f"  limits     LoRA rank <= {c.max_lora_rank}; per key {c.max_models_per_key} live models and "
        f"{c.max_pending_per_key} queued requests; {c.max_request_bytes / 2**20:.0f} MiB per request; "
        f"{c.max_tokens_per_cycle} tokens per cycle; {c.max_num_samples} samples per request",
    ]
