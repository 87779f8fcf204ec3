"""The dashboard's loss curves: `loss:sum` of every forward / forward_backward request, with the
number of optimizer steps its model had taken when it ran (a step's chunks and accumulated
micro-batches share that number: their sum is the step's loss)."""

from __future__ import annotations

import time

from .records import LossPoint, Table


class LossTable(Table):
    SCHEMA = """
CREATE TABLE IF NOT EXISTS request_losses (
    model_id TEXT NOT NULL,
    seq_id INTEGER NOT NULL,
    step INTEGER NOT NULL,
    forward_only INTEGER NOT NULL,
    loss_sum REAL NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (model_id, seq_id)
);
"""

    def record(self, rows: list[tuple[str, int, int, bool, float]]) -> None:
        """(model_id, seq_id, step, forward_only, loss_sum) per finished request; a retry replaces its row."""
        now = time.time()
        if not rows:
            return
        self.db.executemany(  # one write on the writer (one commit), however many tenants the cycle ran
            "INSERT OR REPLACE INTO request_losses(model_id, seq_id, step, forward_only, loss_sum, created_at)"
            " VALUES (?,?,?,?,?,?)", [(m, q, s, int(f), loss, now) for m, q, s, f, loss in rows])

    def curve(self, model_id: str) -> list[LossPoint]:
        """Per optimizer step: the summed `loss:sum` of its training requests (and of its forward-only ones)."""
        return self._records(
            LossPoint, "SELECT step, SUM(CASE WHEN forward_only = 0 THEN loss_sum END) AS train_loss_sum,"
            " SUM(CASE WHEN forward_only = 1 THEN loss_sum END) AS eval_loss_sum, COUNT(*) AS requests"
            " FROM request_losses WHERE model_id = ? GROUP BY step ORDER BY step", (model_id,))
