"""`copy_weights`: a checkpoint copied into a project, sharing its storage with the source.

The copy is a new checkpoint of the same kind and name in a new training run that can never be trained
(status `copied`: it is never loaded, so every training request names a model that is not loaded). Its
files are hard links to the source's: no byte is copied, and the source's deletion (which removes its
folder) leaves the copy's files, and so the copy, whole. A checkpoint is never changed in place (an
overwrite writes a new folder), so the two never see each other's changes.

The copy goes into the session named (`session_id`, `model_seq_id`: its run takes that slot, its project
is the session's) or into a new session of the caller's in `destination_project_id`. The SDK keeps one
`X-Idempotency-Key` across the retries of one call: a retry finds the copy the first attempt made.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from ..accounts.access import Access
from ..checkpoints.format import read_manifest, write_atomically
from ..checkpoints.paths import TinkerPath
from ..errors import UserError
from ..requests.kinds import MAX_TTL_S
from ..server.core import Server
from . import checkpoint_base_model
from .training import training_run_id

MIN_COPY_TTL_S = 3600  # the SDK documents 1 hour to 10 years
COPIED = "copied"  # a copy's run: never loaded, never trained


def check_copy_request(ttl_seconds: int | None, weights_access_token: str | None) -> None:
    if weights_access_token is not None:
        raise UserError("weights_access_token: this server has no access tokens for other accounts' weights; copy "
                        "a checkpoint your own API key can read (yours, or a published one)")
    if ttl_seconds is not None and not MIN_COPY_TTL_S <= ttl_seconds <= MAX_TTL_S:
        raise UserError(f"ttl_seconds must be between {MIN_COPY_TTL_S} (1 hour) and {MAX_TTL_S} (10 years), or "
                        f"unset for no expiry; got {ttl_seconds}")


def copy_weights(server: Server, access: Access, owner: str, source_path: str, *, project_id: str | None,
                 session_id: str | None, model_seq_id: int | None, ttl_seconds: int | None,
                 idempotency_key: str | None) -> str:
    """The tinker:// path of the copy (a retry with the same `idempotency_key` gets the first copy's)."""
    if session_id is None and project_id is None:
        raise UserError("destination_project_id is needed (or session_id and model_seq_id): where the copy goes")
    if session_id is not None and model_seq_id is None:
        raise UserError("model_seq_id is needed with session_id: the slot of the session the copy's run takes")
    source = TinkerPath.parse(source_path)
    row = access.checkpoint(owner, source.run, source.checkpoint_id)  # another key's private one: NotFound
    base_model = checkpoint_base_model(Path(row.dir), source_path)
    if session_id is not None:
        project_id = access.session(owner, session_id).project_id
        run_id = training_run_id(session_id, model_seq_id)
    else:
        session_id = server.store.sessions.create(
            f"sess-{uuid.uuid4().hex[:16]}", owner, ["copy_weights"], {}, None, project_id,
            idempotency_key=None if idempotency_key is None else f"copy_weights:{idempotency_key}")
        run_id = training_run_id(session_id, 0)
    copy = TinkerPath(run_id, source.kind, source.name)
    with server.checkpoints.lock:  # the source stays as it is while it is linked; the run and its copy appear together
        existing = server.store.runs.get(run_id)
        if existing is not None:
            if existing.owner == owner and existing.status == COPIED and server.checkpoints.record(copy) is not None:
                return str(copy)  # a retry of this copy
            raise UserError(f"model_seq_id {model_seq_id} of session {session_id!r} already holds a training run; "
                            "give the copy a slot of its own")
        lora = read_manifest(Path(row.dir)).lora_config.config().to_dict()
        server.store.runs.create(run_id, session_id, owner, base_model, lora, {"type": "adamw"},
                                 {"copied_from": str(source)})
        server.store.runs.set_status(run_id, COPIED)
        files = server.checkpoints.files(source)
        server.checkpoints.save(copy, owner, lambda folder: write_atomically(folder, lambda tmp: _link(files, tmp)),
                                overwrite=False, ttl_seconds=ttl_seconds, user_metadata={"copied_from": str(source)})
    server.accounting.audit("checkpoint_copy", owner, tinker_path=str(copy), model_id=run_id,
                            source_path=str(source), project_id=project_id)
    return str(copy)


def _link(files: list[Path], folder: Path) -> None:
    """Hard links to `files` in `folder`: the copy shares the source's bytes."""
    for f in files:
        os.link(f, folder / f.name)
