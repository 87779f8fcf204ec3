"""`OptimSteps`: a cycle's optimizer steps, launched as one and answered after the cycle's wait.

All of a cycle's optim_steps are launched as one multi-adapter AdamW step, before the cycle's one
wait for the device, and read after it. A step the runtime skipped (non-finite gradients) is the
user's failure; a launch or a read that raises fails every step of the cycle as the server's. A
step that was applied tells the sampling backend of the model's new weights, after it is answered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .cycle_plan import Request
from ..errors import UserError
from ..requests.futures import FutureStore
from ..runtime.model_runtime import ModelRuntime
from .request_failures import answer_or_fail, only_loaded
from .request_parts import LaunchedGradients
from ..requests.kinds import OptimStepResult
from ..runtime.adamw import PendingSteps
from ..runtime.adapters import SkippedStep

log = logging.getLogger(__name__)

# A cycle's launched steps: their requests, and what the runtime reads after the wait.
LaunchedSteps = tuple[list[Request], PendingSteps]


class OptimSteps:
    def __init__(self, runtime: ModelRuntime, futures: FutureStore, launched: LaunchedGradients,
                 new_weights: Callable[[str], None]):
        self.runtime = runtime
        self.futures = futures
        self.launched = launched  # a step spends its model's launched gradients
        self.new_weights = new_weights  # told of each model whose step was applied

    def launch(self, reqs: list[Request]) -> LaunchedSteps | None:
        """All of the cycle's optimizer steps launched as one multi-adapter AdamW step (read after
        the cycle's wait: `answer`)."""
        ready = only_loaded(self.runtime, self.futures, reqs, prefix="optim_step: ")
        if not ready:
            return None
        self.launched.stepped(r.model_id for r in ready)
        try:
            # A model appears at most once per cycle (its optim_step is its barrier).
            return ready, self.runtime.launch_optim_steps([(r.model_id, r.payload) for r in ready])
        except Exception as e:
            self._fail(ready, e)
            return None

    def answer(self, ready: list[Request], pending: PendingSteps) -> None:
        try:
            results = pending.results()
        except Exception as e:
            self._fail(ready, e)
            return
        for r, result in zip(ready, results):
            answer_or_fail(self.futures, r, lambda req: self._answer_one(req, result))
        for r, result in zip(ready, results):
            if not isinstance(result, SkippedStep):
                self.new_weights(r.model_id)

    def _fail(self, ready: list[Request], e: Exception) -> None:
        log.exception("optimizer step over %d models failed", len(ready), exc_info=e)
        for r in ready:
            self.futures.fail(r.request_id, f"optim_step failed on the server: {type(e).__name__}: {e}", "server")

    def _answer_one(self, req: Request, result: dict[str, float] | SkippedStep) -> None:
        if isinstance(result, SkippedStep):
            raise UserError(result.reason)
        self.futures.resolve(req.request_id, OptimStepResult(result).to_wire())
