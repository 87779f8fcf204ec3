"""The service layer: what the routes ask of the server, in the server's own terms.

Routes (`api/`) parse and answer HTTP; these modules check access, validate against the model and
the server's limits, record futures and hand work to the scheduler or the sampler. Nothing in here
knows about HTTP beyond raising `HTTPException` with the message a user should read.
"""

from fastapi import HTTPException

from ..config import ServerConfig


def check_base_model(config: ServerConfig, base_model: str | None) -> None:
    """A request naming a base model (None: it names none) must name the one served here."""
    if base_model is not None and base_model != config.base_model:
        raise HTTPException(400, f"base model {base_model!r} is not served here; this server serves "
                                 f"{config.base_model!r}")
