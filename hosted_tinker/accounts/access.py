"""`Access`: may this API key use this object? Asked by every route, on every use.

Every object has an owner (the owner id of the API key that made it). To any other key it does
not exist: a `NotFound` (a 404), worded like the one for an object that never existed, so
existence does not leak. The one exception is a published checkpoint, which any key may read
(list, describe, download, load, sample) and only its owner may change (publish, TTL, delete); to
other keys it and its run and session show their public fields only, never the owner's metadata,
names, project or status.
An expired checkpoint is gone for every purpose at once, before the sweeper removes its files.

Nothing is remembered between uses. A sampling session opened on someone's published checkpoint
samples it only while it is still readable: once it is unpublished, deleted, expired, or saved
over privately under the same name, the next request is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from ..checkpoints.catalog import is_expired
from ..checkpoints.paths import TinkerPath
from ..errors import Forbidden, NotFound
from ..store.tables import Store
from ..store.records import CheckpointRecord, FutureRecord, ModelRecord, SamplingSessionRecord, SessionRecord


def owned(record, owner: str, not_found: str):
    """`record` if this key owns it; else NotFound, the same whether it is absent or another key's."""
    if record is None or record.owner != owner:
        raise NotFound(not_found)
    return record


@dataclass(frozen=True)
class SamplerGrant:
    """A sampling session this key may use now, and the adapter directory it samples (None = base model)."""

    row: SamplingSessionRecord
    adapter_dir: str | None


class Access:
    def __init__(self, store: Store, is_loaded: Callable[[str], bool], admins: Iterable[str] = (),
                 on_read: Callable[[str, CheckpointRecord, str], None] = lambda owner, row, purpose: None):
        self.store = store
        self._is_loaded = is_loaded
        self.admins = frozenset(admins)  # owners with the admin role (--admin-users)
        self._on_read = on_read  # (owner, checkpoint, purpose) of each read: the audit log

    def admin(self, owner: str) -> None:
        """The admin role's calls (usage, storage, audit log): `Forbidden` naming the role for anyone else."""
        if owner not in self.admins:
            raise Forbidden(f"this call needs the admin role, which {owner!r} does not hold (the server's operator "
                            "grants it with --admin-users)")

    def session(self, owner: str, session_id: str) -> SessionRecord:
        return owned(self.store.sessions.get(session_id), owner, f"session {session_id!r} not found")

    def model(self, owner: str, model_id: str) -> ModelRecord:
        """A training model of this key's, loaded or not."""
        return owned(self.store.runs.get(model_id), owner, f"model {model_id!r} not found")

    def loaded_model(self, owner: str, model_id: str) -> ModelRecord:
        """A training model of this key's that this server holds now (it can take work)."""
        row = self.model(owner, model_id)
        if row.status != "active" or not self._is_loaded(model_id):
            raise NotFound(f"model {model_id!r} is not loaded on this server (was it unloaded, or created "
                           "before a restart?); create a training client from its last checkpoint")
        return row

    def future(self, owner: str, request_id: str) -> FutureRecord:
        return owned(self.store.futures.get(request_id), owner, f"unknown request_id {request_id!r}")

    def checkpoint(self, owner: str, run_id: str, checkpoint_id: str, *, write: bool = False) -> CheckpointRecord:
        """A live checkpoint this key owns, or, to read it, one that is published."""
        row = self.store.checkpoints.get(run_id, checkpoint_id)
        if row is None or is_expired(row) or (row.owner != owner and (write or not row.public)):
            raise NotFound(f"checkpoint {TinkerPath.of_record(run_id, checkpoint_id)} not found")
        return row

    def read(self, owner: str, run_id: str, checkpoint_id: str, purpose: str) -> CheckpointRecord:
        """A checkpoint this key reads (`purpose`: download, load or sample), checked as `checkpoint` and
        recorded in the audit log."""
        row = self.checkpoint(owner, run_id, checkpoint_id)
        self._on_read(owner, row, purpose)
        return row

    def run(self, owner: str, run_id: str) -> tuple[ModelRecord, bool]:
        """(the run's record, whether this key owns it). Others see a run only while it holds a live
        published checkpoint, and then only its public fields (api/rest.py shapes them)."""
        row = self.store.runs.get(run_id)
        if row is not None:
            if row.owner == owner:
                return row, True
            if self.store.checkpoints.run_has_public(run_id):
                return row, False
        raise NotFound(f"training run {run_id!r} not found")

    def sampler(self, owner: str, sampling_session_id: str) -> SamplerGrant:
        """A sampling session of this key's, with the checkpoint it samples checked again now."""
        row = owned(self.store.sampling_sessions.get(sampling_session_id), owner,
                    f"sampling session {sampling_session_id!r} not found")
        path = row.model_path
        if path is None:
            return SamplerGrant(row, None)
        # Checked when the session was made: 'tinker://<run>/<kind>/<name>'.
        where = TinkerPath.parse(path)
        try:
            ckpt = self.checkpoint(owner, where.run, where.checkpoint_id)
        except NotFound:
            raise NotFound(f"sampling session {sampling_session_id!r} samples {path}, which this key can no longer "
                           "read (deleted, expired, unpublished or saved over); open a new session") from None
        return SamplerGrant(row, ckpt.dir)
