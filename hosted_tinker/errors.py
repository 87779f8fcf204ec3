"""Domain errors: what a request asked for cannot be done, said in the server's own terms.

Code that checks a request against what the server holds (a model that is not loaded, a LoRA
config that adapts nothing, a name already taken) raises `UserError` with a message for the
user; the request fails with category "user". Every other exception raised while running a
request is the server's fault (category "server"), whatever its class: a `KeyError` or
`ValueError` from a bug must not be blamed on the user.

The service layer (`services/`, `access.py`) raises these and never speaks HTTP: `api/app.py`
alone maps each class to a status code (`UserError` 400, `Forbidden` 403, `NotFound` 404, `Busy` 429,
`QueryTooSlow` 400).
"""

from __future__ import annotations

import json
from dataclasses import dataclass


class UserError(Exception):
    """Raised only by validation code; its message is shown to the user as is."""


class NotFound(UserError):
    """The object does not exist, or this key may not see it (told apart by nobody)."""


class Forbidden(UserError):
    """This key may not make this call at all: it lacks the role the message names."""


class Busy(UserError):
    """This key has as much work in flight as a limit allows: retry after `retry_after_s` seconds
    (the SDK treats it as back-pressure and does)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueryTooSlow(UserError):
    """A query this key shaped (a search, a listing's page) ran past the server's time budget for one
    query and was stopped; asking again the same way would too, so it is no back-pressure to retry."""


class MachineFault(RuntimeError):
    """A pass failed for a reason of the machine's, not of any of its requests: nothing is rerun."""


@dataclass(frozen=True)
class Failure:
    """The body of a failed future. category: "user" (the request asked for the impossible) or
    "server" (retry it, or report it)."""

    error: str
    category: str

    def to_wire(self) -> bytes:
        return json.dumps({"error": self.error, "category": self.category}).encode()
