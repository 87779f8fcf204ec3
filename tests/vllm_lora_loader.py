"""Run by vLLM's interpreter (tests/test_vllm_moe_layout.py): vLLM 0.32's own loading of one LoRA
adapter folder for a model, on CPU, without its engine or any kernel.

The steps are those of vLLM's CPU worker and its `load_lora_adapter`: the model as the worker builds
it, the LoRA manager (which wraps the modules --lora-target-modules names: FusedMoEWithLoRA on MoE
experts), the worker's adapter load (its expected-module check, the model's name mapping), the
manager's packing (per-expert LoRAs stacked by PackedLoRALayerWeights.pack_moe, scalings folded
into B) and the activation that copies the adapter into the wrapped layers' stacked buffers.

usage: python vllm_lora_loader.py < SPECS, SPECS a JSON list of {"model": DIR, "adapter": DIR, "out": FILE,
"targets": [...], "max_lora_rank": N} (read once vLLM is imported: a caller may start this first). For each, writes to "out" the stacked buffers of every wrapped MoE layer at the adapter's slot,
'<experts module>.<w1|w2|w3>.lora_<A|B>' ([E, max rank, in] / [E, out, max rank]), and in its
metadata the wrapped modules' classes and the adapter's modules that no wrapped module takes.
"""

import json
import socket
import sys

import torch
from safetensors.torch import save_file
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel, model_parallel_is_initialized
from vllm.engine.arg_utils import EngineArgs
from vllm.lora.layers.fused_moe import FusedMoEWithLoRA
from vllm.lora.request import LoRARequest
from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
from vllm.model_executor.model_loader import get_model
from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load(spec: dict) -> None:
    config = EngineArgs(model=spec["model"], dtype="float32", enable_lora=True, max_lora_rank=spec["max_lora_rank"],
                        max_loras=1, lora_target_modules=spec["targets"], max_model_len=256, enforce_eager=True,
                        max_num_seqs=4).create_engine_config()
    with set_current_vllm_config(config):
        if not model_parallel_is_initialized():  # once per process: one model after another
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
            initialize_model_parallel(1, 1)
        model = get_model(vllm_config=config)
        worker = LRUCacheWorkerLoRAManager(config, torch.device("cpu"), model.embedding_modules)
        worker.create_lora_manager(model, config)
        manager = worker._adapter_manager
        lora = worker._load_adapter(LoRARequest("probe", 1, spec["adapter"]))
        manager.add_adapter(lora)
        manager.activate_adapter(lora.id)
    slot = manager.lora_index_to_id.index(lora.id)
    buffers = {}
    for name, module in manager.modules.items():
        if isinstance(module, FusedMoEWithLoRA):
            # set_lora: w1 (gate) -> w13 slice 0, w3 (up) -> w13 slice 1, w2 (down) -> w2
            for target, a, b in (("w1", module.w13_lora_a_stacked[0], module.w13_lora_b_stacked[0]),
                                 ("w3", module.w13_lora_a_stacked[1], module.w13_lora_b_stacked[1]),
                                 ("w2", module.w2_lora_a_stacked[0], module.w2_lora_b_stacked[0])):
                buffers[f"{name}.{target}.lora_A"] = a[slot].contiguous()
                buffers[f"{name}.{target}.lora_B"] = b[slot].contiguous()
    wrapped = {name: type(module).__name__ for name, module in manager.modules.items()}
    save_file(buffers, spec["out"], metadata={"wrapped": json.dumps(wrapped),
                                               "unplaced": json.dumps(sorted(set(lora.loras) - set(wrapped)))})


if __name__ == "__main__":
    _set_torch_accelerator_to_noop()  # as vLLM's CPU worker does: model loading calls empty_cache
    for spec in json.load(sys.stdin):
        load(spec)
