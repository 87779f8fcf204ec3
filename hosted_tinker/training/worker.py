"""`TrainingWorker`: executes one clock cycle against the model runtime and answers its futures.

The scheduler decides *what* runs together; this module runs it, in per-model order: one fused
forward/backward over every model's compute requests (`ComputeRequests`, compute_requests.py),
then each ready optimizer step (`OptimSteps`, optim_steps.py), both launched, then read after the
cycle's one wait for the device; then the checkpoint saves and loads, creates and unloads
(`TailRequests`, tail_requests.py). A request that cannot be done fails with category "user" only
when validation code said so (request_failures.py); anything else is the server's fault. An
exception that escapes a cycle is the device loop's to answer (device_loop.py).
"""

from __future__ import annotations

from collections.abc import Callable

from ..checkpoints.catalog import CheckpointCatalog
from .compute_requests import ComputeRequests, LaunchedOutcome
from .cycle_plan import CyclePlan, Request
from ..requests.futures import FutureStore
from ..runtime.model_runtime import ModelRuntime
from .optim_steps import OptimSteps
from ..sampling.backend import SamplingBackend
from ..store.tables import Store
from .tail_requests import TailRequests


class TrainingWorker:
    def __init__(self, runtime: ModelRuntime, futures: FutureStore, store: Store, checkpoints: CheckpointCatalog,
                 sampling: SamplingBackend):
        self.runtime, self.futures = runtime, futures  # the one wait; the cycle's answers in one transaction
        self.compute = ComputeRequests(runtime, futures, store)
        self.tail = TailRequests(runtime, futures, store, checkpoints, sampling)
        self.optim = OptimSteps(runtime, futures, self.compute.launched, new_weights=self.tail.new_weights)

    def run_cycle(self, plan: CyclePlan, on_compute_answered: Callable[[set[str]], None],
                  join_optim: Callable[[], None] = lambda: None) -> None:
        """Run the plan, answering each request as it completes. The passes and the optimizer
        steps are launched, then the cycle waits for the device once and reads them all (on a GPU
        the cycle's one host sync). `join_optim` runs once the passes are launched: it may add
        optim_steps that arrived meanwhile to `plan.optim`. `on_compute_answered` hears which
        models' compute results are handed out, just before the first of them is (a request that
        a client posts once it has seen its result then always finds the scheduler told: it is
        never taken for a pipelining client's)."""
        self.compute.settle()  # requests that failed since the last cycle (a cycle that raised)
        passes: list[tuple[Request, LaunchedOutcome]] = []
        if plan.compute:
            models = {r.model_id for r in plan.compute}

            def answering() -> None:
                join_optim()
                on_compute_answered(models)

            passes = self.compute.launch(plan.compute, answering=answering)
        steps = self.optim.launch(plan.optim) if plan.optim else None
        self.runtime.wait()
        with self.futures.answering(touched_models=plan.models):  # one SQLite transaction for them all
            self.compute.answer(passes)
            if steps is not None:
                self.optim.answer(*steps)
        for req in plan.tail:
            self.tail.run(req)
        for req in plan.orphaned:
            self.futures.fail(req.request_id, f"{req.kind}: model {req.model_id!r} is not loaded (it was unloaded)",
                              "user")
        self.compute.settle()  # e.g. a request in parts orphaned by its model's unload
