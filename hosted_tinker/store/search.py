"""Session search over the store's tables (`RestClient.search_sessions`): one SQL query per page.

A session is visible to its owner, and to other keys only while one of its runs holds a live published
checkpoint (as `list_training_runs(access_scope="accessible")` shows runs): a private session of another
owner never appears, whatever the filters. A filter on a private field (display name, metadata, project,
status) matches the caller's own sessions only, so that no guess about another owner's is confirmed;
the public ones (session id, owner) match any visible session. Pages are newest first, with a keyset
cursor (created_at, session_id), so a page is as cheap at the millionth session as at the first.

Indexes make a page cheap: sessions are read in page order from an index (per owner, or of all owners)
until a page is full, rather than every candidate read and sorted; and a metadata filter is a lookup:
each session's text-valued user_metadata pairs are also rows of `session_metadata` (written with the
session), where `json_each` over the stored JSON parsed every candidate's metadata once per filter
(64 filters over 400 sessions of 62 KB: seconds). Every query here is budgeted (sqlite_db.py): past the
time budget the search is refused, naming it.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass

from .database import SQLiteDB
from .records import SessionRecord, from_row

DEFAULT_PROJECT = "default"  # the project of a session created without one

# Pages are ordered by whole microseconds, what a cursor's timestamp carries (Python truncates the same way);
# the indexes' expression is the same as the query's, or SQLite cannot read a page in index order.
_MICROS = "CAST(s.created_at * 1000000 AS INTEGER)"
PAGE_INDEXES = """
CREATE INDEX IF NOT EXISTS sessions_page ON sessions(CAST(created_at * 1000000 AS INTEGER) DESC, session_id);
CREATE INDEX IF NOT EXISTS sessions_owner_page ON sessions(owner, CAST(created_at * 1000000 AS INTEGER) DESC,
                                                           session_id);
"""
METADATA_SCHEMA = """
CREATE TABLE IF NOT EXISTS session_metadata (
    session_id TEXT NOT NULL,
    key TEXT NOT NULL,
    value TEXT NOT NULL,             -- the text values only: a filter matches text
    PRIMARY KEY (session_id, key)
) WITHOUT ROWID;                     -- a filter's lookup finds the value in the key's own b-tree: one search, not two
"""


def metadata_rows(session_id: str, user_metadata: dict) -> list[tuple[str, str, str]]:
    """A session's rows of `session_metadata`: its pairs whose value is text."""
    return [(session_id, key, value) for key, value in user_metadata.items() if isinstance(value, str)]


def create_search_indexes(db: SQLiteDB) -> None:
    """At start-up: the page indexes, and `session_metadata`, filled from the sessions already stored
    when it is new (the table and its rows appear in one transaction, so a kill in between leaves neither)."""
    db.create(PAGE_INDEXES)

    def create(c: sqlite3.Connection) -> None:
        if c.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'session_metadata'").fetchone():
            return
        c.execute(METADATA_SCHEMA)
        for session_id, user_metadata in c.execute("SELECT session_id, user_metadata FROM sessions"):
            pairs = json.loads(user_metadata)
            if isinstance(pairs, dict):
                c.executemany("INSERT INTO session_metadata(session_id, key, value) VALUES (?,?,?)",
                              metadata_rows(session_id, pairs))

    db.migrate(create)


@dataclass(frozen=True)
class SessionFilter:
    caller: str
    owners: frozenset[str] | None  # None: every owner
    session_id: str | None
    name_words: tuple[str, ...]  # each must appear in the display name (case-insensitive)
    metadata: dict[str, str]  # every pair must hold
    projects: frozenset[str] | None
    statuses: frozenset[str] | None  # stored statuses: active, success, errored, interrupted
    limit: int
    after: tuple[int, str] | None  # the last page's last (created_at in microseconds, session_id)


@dataclass(frozen=True)
class FoundSession:
    record: SessionRecord
    checkpoints: int  # live checkpoints of its runs the caller may see
    checkpoint_bytes: int


_LIVE_PUBLIC = ("EXISTS (SELECT 1 FROM models m JOIN checkpoints c ON c.model_id = m.model_id WHERE m.session_id ="
                " s.session_id AND c.public = 1 AND (c.expires_at IS NULL OR c.expires_at > :now))")
_OWN = "s.owner = :caller"
_VISIBLE = f"({_OWN} OR {_LIVE_PUBLIC})"


def micros(t: float) -> int:
    """A stored time as the search orders it."""
    return int(t * 1000000)


def _like(word: str) -> str:
    return "%" + word.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


class SessionSearch:
    def __init__(self, db: SQLiteDB):
        self.db = db

    def find(self, f: SessionFilter) -> list[FoundSession]:
        """Up to `f.limit` visible sessions that match, newest first, after `f.after`."""
        where, args = [_VISIBLE], {"caller": f.caller, "now": time.time(), "limit": f.limit}
        if f.owners is not None:
            where.append(f"s.owner IN ({self._names(args, 'owner', f.owners)})")
        matches = []
        if f.session_id is not None:
            matches.append("s.session_id = :session_id")
            args["session_id"] = f.session_id
        if f.name_words:
            for i, word in enumerate(f.name_words):
                args[f"word{i}"] = _like(word)
            matches.append(f"({_OWN} AND " + " AND ".join(f"LOWER(COALESCE(s.display_name, '')) LIKE :word{i}"
                                                          " ESCAPE '\\'" for i in range(len(f.name_words))) + ")")
        if matches:
            where.append("(" + " OR ".join(matches) + ")")  # the SDK: a session matching either one matches
        if f.metadata or f.projects is not None or f.statuses is not None:
            where.append(_OWN)  # private fields: only the caller's own match
        for i, (key, value) in enumerate(sorted(f.metadata.items())):
            args[f"mkey{i}"], args[f"mvalue{i}"] = key, value
            where.append(f"EXISTS (SELECT 1 FROM session_metadata sm WHERE sm.session_id = s.session_id"
                         f" AND sm.key = :mkey{i} AND sm.value = :mvalue{i})")
        if f.projects is not None:
            where.append(f"COALESCE(s.project_id, '{DEFAULT_PROJECT}') IN ({self._names(args, 'project', f.projects)})")
        if f.statuses is not None:
            where.append(f"s.status IN ({self._names(args, 'status', f.statuses)})")
        if f.after is not None:
            args["after_t"], args["after_id"] = f.after
            where.append(f"({_MICROS} < :after_t OR ({_MICROS} = :after_t AND s.session_id > :after_id))")
        sql = (f"SELECT s.* FROM sessions s WHERE {' AND '.join(where)} ORDER BY {_MICROS} DESC, s.session_id"
               " LIMIT :limit")
        return [self._counted(from_row(SessionRecord, row), f.caller) for row in self.db.all(sql, args, budgeted=True)]

    @staticmethod
    def _names(args: dict, prefix: str, values: frozenset[str]) -> str:
        for i, value in enumerate(sorted(values)):
            args[f"{prefix}{i}"] = value
        return ", ".join(f":{prefix}{i}" for i in range(len(values)))

    def _counted(self, record: SessionRecord, caller: str) -> FoundSession:
        row = self.db.one("SELECT COUNT(*), COALESCE(SUM(c.size_bytes), 0) FROM checkpoints c JOIN models m ON"
                          " m.model_id = c.model_id WHERE m.session_id = ? AND (c.expires_at IS NULL OR c.expires_at"
                          " > ?) AND (? OR c.public = 1)", (record.session_id, time.time(), record.owner == caller),
                          budgeted=True)
        return FoundSession(record, row[0], row[1])

    def listable_projects(self, caller: str, projects: frozenset[str]) -> set[str]:
        """Those of `projects` that hold a session of the caller's (a project is its owner's private label)."""
        args = {"caller": caller}
        names = self._names(args, "project", projects)
        rows = self.db.all(f"SELECT DISTINCT COALESCE(s.project_id, '{DEFAULT_PROJECT}') FROM sessions s WHERE"
                           f" {_OWN} AND COALESCE(s.project_id, '{DEFAULT_PROJECT}') IN ({names})", args,
                           budgeted=True)
        return {r[0] for r in rows}
