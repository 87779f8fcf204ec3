"""How the worker fails a request it cannot do: whose fault it is, and the message it gets.

A request fails with category "user" only when validation code said so (`UserError`,
`CheckpointError`); anything else (a `KeyError` from a bug, a device fault) is the server's
fault, logged with its traceback, and the client may retry it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..checkpoints.format import CheckpointError
from .cycle_plan import Request
from ..errors import UserError
from ..requests.futures import FutureStore
from ..runtime.model_runtime import ModelRuntime

log = logging.getLogger(__name__)


def is_users_fault(error: BaseException) -> bool:
    """Whether validation code raised `error`: the request asked for the impossible."""
    return isinstance(error, (UserError, CheckpointError))


def answer_or_fail(futures: FutureStore, req: Request, answer: Callable[[Request], None]) -> None:
    """Run `answer(req)`; if it raises, fail the request, as the user's or the server's fault."""
    try:
        answer(req)
    except Exception as e:
        if is_users_fault(e):
            futures.fail(req.request_id, f"{req.kind}: {e}", "user")
        else:  # a bug or a device fault, whatever its class: retry or report it
            log.exception("%s of model %s failed", req.kind, req.model_id)
            futures.fail(req.request_id, f"{req.kind} failed on the server: {type(e).__name__}: {e}", "server")


def only_loaded(runtime: ModelRuntime, futures: FutureStore, reqs: list[Request], prefix: str = "") -> list[Request]:
    """The requests whose model is loaded; the others fail (unloaded since they were queued)."""
    loaded = []
    for r in reqs:
        if r.model_id in runtime.adapters:
            loaded.append(r)
        else:
            futures.fail(r.request_id, f"{prefix}model {r.model_id!r} is not loaded", "user")
    return loaded
