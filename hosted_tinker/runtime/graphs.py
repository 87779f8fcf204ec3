"""Training micro-batches as CUDA graphs: a step launches one graph, not thousands of kernels.

Measured on an H200 (the 1.4B Qwen3-shaped body, rank-16 LoRA on every projection, 2 x 128
tokens per tenant, batch-invariant settings on): one tenant's forward + backward took 297 ms of
host time eagerly (~12k launches, each ~20 us with cuBLASLt) and 24 ms as a graph replay; sixteen
tenants' 348 ms and 118 ms.

`StepGraphs` keeps one graph per micro-batch layout (`key`: which rows of which model, the loss
of each run, the adapters' slots, the slot stacks' storage). A training loop repeats its
layouts, so after a tenant's first step of a shape each of its steps is a replay:

- the inputs of a layout live in static buffers (`Entry.inputs`): a step copies its tokens,
  targets and loss inputs into them from pinned host memory (non-blocking), replays the graph,
  and copies the outputs (per-token logprobs and losses) out to pinned host memory
  (non-blocking); the host waits once, when the whole pass is launched (`TrainingRuntime`);
- the graph's backward adds into the adapters' gradient rows in place (they are stack storage,
  at fixed addresses), exactly as the eager pass does; a slot stack that grows moves that
  storage, and `key` carries `LoRARouting.storage_version`, so a stale graph is never replayed;
- the first time a layout is seen it runs once eagerly (cuBLAS, cuDNN and autograd initialise
  what they need outside the capture), its gradients are put back, then it is captured and
  replayed: every result of a graphed layout comes from a replay, its first one included;
- all graphs share one memory pool (they run one after another on one stream, and each one's
  outputs are copied out before the next runs), and at most `max_graphs` are kept (LRU).

Which micro-batches are graphed is the runtime's choice (`TrainingRuntime.requests`): those whose
losses are pure tensor code; gspo's and stable_reinforce's compute values on the host and run
eagerly, in micro-batches of their own (runtime/packing.py, `Request.kind`), so a tenant's path
never depends on its neighbours.

The optimizer step is not captured yet, but it could be: it launches with no host sync
(adamw.launch_adamw: the skip of a non-finite step is a device-side `found_inf`, the put-back of
an unproven one a device-side `where`, the constants it reads are made once), so a cycle of a
replayed layout waits for the device once. What capturing it still needs: its key (the stepping
adapters, their slots, hyper-parameters and which of them copy their state), the learning rate
as a tensor input, and the moments of a tenant's first step made before the capture (a tensor
allocated inside a capture lives in the graphs' shared pool).

On CPU there are no graphs; `capture` is injectable so the suite checks the static-buffer logic
with a stand-in that re-runs the step on the static buffers (tests/test_graphs.py). The GPU tests
(tests/test_gpu_training.py, HOSTED_TINKER_TEST_DEVICE=cuda) run the real thing.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

Step = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, ...]]


@dataclass
class Entry:
    inputs: dict[str, torch.Tensor]  # static input buffers on the device
    outputs: tuple[torch.Tensor, ...]  # static outputs the replay writes
    replay: Callable[[], None]
    # What the captured kernels read that the step did not allocate (the LoRA plans' slot index
    # tensors): kept alive with the graph, or their memory would be reused under it.
    keep: object = None


class CudaGraphCapture:
    """torch.cuda.CUDAGraph capture on one side stream, all graphs in one memory pool."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()

    def warm_up(self, step: Step, inputs: dict[str, torch.Tensor]) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            step(inputs)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def __call__(self, step: Step, inputs: dict[str, torch.Tensor]) -> Entry:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            outputs = step(inputs)
        return Entry(inputs, outputs, graph.replay)


class StepGraphs:
    """One captured step per layout key, LRU-bounded."""

    def __init__(self, capture, *, max_graphs: int = 64):
        self.capture = capture
        self.max_graphs = max_graphs
        self.entries: OrderedDict[Hashable, Entry] = OrderedDict()
        self.captures = 0
        self.replays = 0
        self.refused: set[Hashable] = set()  # layouts whose capture failed: they run eagerly

    def run(self, key: Hashable, host_inputs: dict[str, torch.Tensor], step: Step,
            put_back: Callable[[], Callable[[], None]], keep: Callable[[], object] = lambda: None
            ) -> tuple[torch.Tensor, ...] | None:
        """Replay `key`'s graph on `host_inputs` (CPU tensors, pinned on CUDA); capture it first if
        new: `put_back()` snapshots what the warm-up changes and returns the function that restores
        it, and `keep()` returns what the captured step read without owning it (`Entry.keep`).
        Returns the static outputs (read or copy them before the next `run`), or None where this
        layout cannot be captured (logged once): the caller runs it eagerly."""
        if key in self.refused:
            return None
        entry = self.entries.get(key)
        if entry is None:
            try:
                entry = self._new(key, host_inputs, step, put_back)
                entry.keep = keep()
            except Exception as e:
                self.refused.add(key)
                log.warning("a training step could not be captured as a CUDA graph (%s: %s); this layout runs "
                            "eagerly", type(e).__name__, e)
                return None
        else:
            self.entries.move_to_end(key)
        for name, host in host_inputs.items():
            entry.inputs[name].copy_(host, non_blocking=True)
        entry.replay()
        self.replays += 1
        return entry.outputs

    def _new(self, key, host_inputs, step, put_back) -> Entry:
        while len(self.entries) >= self.max_graphs:
            self.entries.popitem(last=False)
        device = self.capture.device
        inputs = {name: host.to(device) for name, host in host_inputs.items()}
        restore = put_back()
        try:
            self.capture.warm_up(step, inputs)
            entry = self.capture(step, inputs)  # records; the gradient rows change only on replay
        finally:
            restore()
        self.entries[key] = entry
        self.captures += 1
        log.debug("captured a training step graph (%d kept)", len(self.entries))
        return entry
