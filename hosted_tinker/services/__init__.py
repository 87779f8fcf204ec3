"""The service layer: what the routes ask of the server, in the server's own terms.

Routes (`api/`) parse and answer HTTP; these modules check access, validate against the model and
the server's limits, record futures and hand work to the scheduler or the sampler. Nothing in here
knows about HTTP: a refusal is a domain error (`errors.py`) with the message a user should read,
and `api/app.py` gives it its status code.

Each request goes to one served base model (`served_model`): the one it names, or the one its
training model, sampling session or checkpoint was made on.

May import server/, accounts/, the typed values of training/cycle_plan.py, requests/ and
sampling/jobs.py, and every floor below; never a device-side module and never HTTP.
"""

from pathlib import Path

from ..checkpoints.format import CheckpointError, read_manifest
from ..errors import UserError
from ..server.served_models import ServedModel


def served_model(server, base_model: str) -> ServedModel:
    """The served model named `base_model`, or a UserError naming the ones this server serves."""
    return server.models.get(base_model)


def checkpoint_base_model(folder: Path, path: str) -> str:
    """The base model a stored checkpoint was trained on (its manifest says), or a UserError."""
    try:
        return read_manifest(folder).base_model
    except CheckpointError as e:
        raise UserError(f"checkpoint {path} cannot be loaded: {e}") from None
