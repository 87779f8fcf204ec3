"""The model on the device: the fused multi-tenant forward/backward, the multi-LoRA layers
and their kernels, the many-adapter AdamW, the losses, and the worker pool of torch.distributed
ranks. `model_runtime.ModelRuntime` is the seam the worker, the checkpoints and the sampler use.

May import requests/ (the work and its outcome), models/, observability/ (the pool's log format),
store/ and the ground floor. Never the scheduler, the worker or the services.
"""
