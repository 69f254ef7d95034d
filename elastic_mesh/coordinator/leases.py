"""Exactly-once work: the run's data shards, who holds each, and how far each is consumed.

The coordinator knows nothing of documents or tokens. A shard is an index; its cursor is an opaque
list of integers that only the nodes interpret (for prime: document and token offset). A worker (one
local rank of a node) leases a free shard and reads from the shard's committed cursor on. The cursor
moves only when an outer step that averaged that worker's pseudo-gradient is applied, in the same
transaction as the decision, so:

- a node that dies, is refused, or misses the step loses only its uncommitted reading: its shards keep
  their committed cursors and go back to the pool (dead) or are re-read by the same node (refused);
- a shard read to its end is free again for its next pass once that step commits.

Every committed range is logged, so an audit can prove each document entered exactly one committed
outer step per pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_MAX_REPORT_ENTRIES = 1024


class LedgerError(ValueError):
    """A lease or report the ledger refuses; the message says why."""


@dataclass
class ShardRange:
    """What a worker read of one shard in one round: from the committed cursor to `end`."""

    worker: int
    shard: int
    pass_: int
    start: list[int]
    end: list[int]
    finished: bool

    @classmethod
    def parse(cls, entry: object, workers: int) -> "ShardRange":
        if not isinstance(entry, dict):
            raise LedgerError(f"a data report entry must be an object, got {type(entry).__name__}")
        try:
            worker, shard, pass_ = int(entry["worker"]), int(entry["shard"]), int(entry["pass"])
            start, end = [int(v) for v in entry["start"]], [int(v) for v in entry["end"]]
            finished = entry["finished"]
        except (KeyError, TypeError, ValueError) as e:
            raise LedgerError(f"malformed data report entry {str(entry)[:120]}: {e}") from None
        if not isinstance(finished, bool) or not 0 <= worker < workers or len(start) > 8 or len(end) > 8:
            raise LedgerError(f"data report entry out of range: {str(entry)[:120]}")
        return cls(worker, shard, pass_, start, end, finished)


def parse_report(report: object, workers: int) -> list[ShardRange]:
    if report is None:
        return []
    if not isinstance(report, list) or len(report) > _MAX_REPORT_ENTRIES:
        raise LedgerError(f"a data report is a list of at most {_MAX_REPORT_ENTRIES} entries")
    return [ShardRange.parse(e, workers) for e in report]


class DataLedger:
    """Runs inside the coordinator's transactions (callers hold its lock and open the transaction)."""

    def __init__(self, db) -> None:
        self.db = db

    @property
    def shards(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM data_shards").fetchone()[0]

    def configure(self, shards: int) -> None:
        """Creates the shard rows once, when the first node that reads data joins."""
        if self.shards == 0 and shards > 0:
            self.db.executemany("INSERT INTO data_shards VALUES (?, 0, '[]', NULL, NULL, NULL)",
                                [(s,) for s in range(shards)])

    def lease(self, node_id: str, worker: int, held: list[int], sticky: str = "") -> dict:
        """A free shard for one worker: the one this worker (`sticky`: node name / local rank) read last,
        if free (a resumed or restarted node reads on where it left off, and a resumed run repeats itself
        exactly), else the one with the fewest passes, lowest index first. `held` lists the shards the
        worker knows it holds: one leased to it that it does not list is an answer that got lost on the
        way (a retried request), and is answered again instead of leasing another."""
        lost = self.db.execute("SELECT shard, pass, cursor FROM data_shards WHERE holder = ? AND worker = ? "
                               "ORDER BY shard", (node_id, worker)).fetchall()
        for row in lost:
            if row[0] not in held:
                return {"shard": row[0], "pass": row[1], "cursor": json.loads(row[2])}
        row = self.db.execute("SELECT shard, pass, cursor FROM data_shards WHERE holder IS NULL "
                              "ORDER BY CASE WHEN sticky = ? THEN 0 ELSE 1 END, pass, shard LIMIT 1", (sticky,)).fetchone()
        if row is None:
            held = self.shards
            raise LedgerError(f"all {held} data shards are leased to other workers; cut the data into more shards "
                              "(data.parts_per_file) than the run has local ranks in all nodes together")
        self.db.execute("UPDATE data_shards SET holder = ?, worker = ?, sticky = ? WHERE shard = ?",
                        (node_id, worker, sticky or None, row[0]))
        return {"shard": row[0], "pass": row[1], "cursor": json.loads(row[2])}

    def release(self, node_id: str) -> int:
        """A node that died or left: its shards go back to the pool at their committed cursors."""
        return self.db.execute("UPDATE data_shards SET holder = NULL, worker = NULL WHERE holder = ?",
                               (node_id,)).rowcount

    def check(self, node_id: str, ranges: list[ShardRange]) -> str | None:
        """Why `ranges` cannot be committed for node_id, or None when every range starts at its shard's
        committed cursor, in a pass and a shard the node holds."""
        for r in ranges:
            row = self.db.execute("SELECT pass, cursor, holder FROM data_shards WHERE shard = ?", (r.shard,)).fetchone()
            if row is None:
                return f"shard {r.shard} does not exist (the run has {self.shards})"
            if row[2] != node_id:
                return f"shard {r.shard} is not leased to this node"
            if row[0] != r.pass_ or json.loads(row[1]) != r.start:
                return (f"shard {r.shard} was read from pass {r.pass_} cursor {r.start}, but its committed position "
                        f"is pass {row[0]} cursor {json.loads(row[1])}")
        return None

    def commit(self, outer_step: int, node_id: str, ranges: list[ShardRange]) -> None:
        for r in ranges:
            if r.finished:  # read to its end: the next pass starts from the top, read by whoever leases it
                self.db.execute("UPDATE data_shards SET pass = pass + 1, cursor = '[]', holder = NULL, worker = NULL "
                                "WHERE shard = ?", (r.shard,))
            else:
                self.db.execute("UPDATE data_shards SET cursor = ? WHERE shard = ?", (json.dumps(r.end), r.shard))
            self.db.execute("INSERT INTO data_log (outer_step, node_id, worker, shard, pass, start, end, finished) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (outer_step, node_id, r.worker, r.shard, r.pass_,
                                                                json.dumps(r.start), json.dumps(r.end), int(r.finished)))

    def roll_back(self, outer_step: int) -> None:
        """The ledger as it was when `outer_step` committed (a whole-run resume from checkpoints): later
        ranges are forgotten, every shard's pass and cursor recomputed from the log, all leases ended."""
        self.db.execute("DELETE FROM data_log WHERE outer_step > ?", (outer_step,))
        for (shard,) in self.db.execute("SELECT shard FROM data_shards").fetchall():
            rows = self.db.execute("SELECT end, finished FROM data_log WHERE shard = ? ORDER BY id", (shard,)).fetchall()
            passes = sum(f for _, f in rows)
            cursor = rows[-1][0] if rows and not rows[-1][1] else "[]"
            self.db.execute("UPDATE data_shards SET pass = ?, cursor = ?, holder = NULL, worker = NULL WHERE shard = ?",
                            (passes, cursor, shard))

    def summary(self) -> dict:
        rows = self.db.execute("SELECT pass, holder FROM data_shards").fetchall()
        return {"shards": len(rows), "leased": sum(1 for _, h in rows if h), "min_pass": min((p for p, _ in rows), default=0),
                "max_pass": max((p for p, _ in rows), default=0)}

    def log(self) -> list[dict]:
        rows = self.db.execute("SELECT outer_step, node_id, worker, shard, pass, start, end, finished FROM data_log "
                               "ORDER BY id").fetchall()
        return [{"outer_step": s, "node_id": n, "worker": w, "shard": sh, "pass": p, "start": json.loads(a),
                 "end": json.loads(b), "finished": bool(f)} for s, n, w, sh, p, a, b, f in rows]
