"""A batch of accounting records whose write fails is kept, whole, for the next flush (accounting_writer.py).

No server: the writer and its three parts on real SQLite. The failure is real: the audit log's table is
dropped under the writer, so the batch's one transaction fails at its audit entries and takes its usage
rows with it; once the table is back, the next flush writes that batch once, with what was counted
meanwhile, the audit entries in time order whichever was recorded first.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from hosted_tinker.accounts.accounting_writer import AccountingWriter
from hosted_tinker.accounts.audit_log import AuditLog
from hosted_tinker.accounts.request_timings import RequestTimings
from hosted_tinker.store.tables import Store
from hosted_tinker.store.accounting import SCHEMA, AccountingTables
from hosted_tinker.accounts.usage_meter import PREFILL, SAMPLE, Payer, UsageMeter

HOUR = 3600 * 500_000  # the start of a UTC hour


def test_a_batch_whose_write_fails_is_written_whole_by_the_next_flush(tmp_path: Path):
    store = Store(tmp_path / "db.sqlite")
    tables = AccountingTables(store.db)
    usage, audit, timings = UsageMeter(store), AuditLog(), RequestTimings()
    writer = AccountingWriter(tables, usage, audit, timings)
    alice = Payer("alice", "session-1")
    usage.count_sample(HOUR + 1, "base", alice, prefill=10, cached=0, sampled=5)
    audit.record("checkpoint_read", "alice", at=HOUR + 2, purpose="download")
    audit.record("checkpoint_delete", "alice", at=HOUR + 1)
    timings.add_sample("session-1", "base", "req-1", "sampler-1", HOUR, None, HOUR + 1, 15, "done")
    timings.add_sample("", "base", "req-2", "", HOUR, None, HOUR + 1, 15, "done")  # no session: no trace

    with store.db.transaction() as c:
        c.execute("DROP TABLE audit_log")
    with pytest.raises(sqlite3.OperationalError, match="audit_log"):
        writer.flush()
    assert tables.usage(HOUR, HOUR + 3600) == []  # the whole batch rolled back

    store.db.create(SCHEMA)
    usage.count_sample(HOUR + 3, "base", alice, prefill=1, cached=0, sampled=1)
    writer.flush()
    writer.flush()  # nothing left: nothing written twice
    quantities = {row.key.kind: row.quantity for row in tables.usage(HOUR, HOUR + 3600)}
    assert quantities == {PREFILL: 11, SAMPLE: 6}
    entries = [entry for _, entry in tables.audit(HOUR, HOUR + 3600, limit=10)]
    assert [(e.event, e.at) for e in entries] == [("checkpoint_delete", HOUR + 1), ("checkpoint_read", HOUR + 2)]
    assert [t.request_id for t in tables.timings("session-1", 10)] == ["req-1"]
    assert tables.timings("", 10) == []
    store.close()
