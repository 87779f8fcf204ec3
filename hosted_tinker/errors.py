"""`UserError`: what the user sent cannot be done, as opposed to the server failing.

Code that checks a request against what the server holds (a model that is not loaded, a LoRA
config that adapts nothing, a name already taken) raises `UserError` with a message for the
user; the request fails with category "user". Every other exception raised while running a
request is the server's fault (category "server"), whatever its class: a `KeyError` or
`ValueError` from a bug must not be blamed on the user.
"""

from __future__ import annotations


class UserError(Exception):
    """Raised only by validation code; its message is shown to the user as is."""
