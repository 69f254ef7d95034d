"""Exactly-once work: leases of numbered work items of any kind, who holds each, how far each is consumed.

One mechanism for every kind of work a run hands out (the data a pretraining run reads today, the
prompts an RL run has rollouts made for next). The coordinator knows nothing of what an item is: an
item is an index; its cursor is an opaque list of integers that only the members interpret (for a
data shard: document and token offset). A worker (one local rank of a node) leases a free item and
consumes it from the item's committed cursor on. The cursor moves only when a round that counted
that worker's contribution is applied, in the same transaction as the decision, so:

- a node that dies, is refused, or misses the round loses only its uncommitted work: its items keep
  their committed cursors and go back to the pool (dead) or are taken again by the same node (refused);
- an item consumed to its end is free again for its next pass once that round commits.

Every committed range is logged, so an audit can prove each piece of work entered exactly one
committed round per pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_MAX_REPORT_ENTRIES = 1024


class LedgerError(ValueError):
    """A lease or report the ledger refuses; the message says why."""


@dataclass
class ItemRange:
    """What a worker consumed of one item in one round: from the committed cursor to `end`."""

    worker: int
    item: int
    pass_: int
    start: list[int]
    end: list[int]
    finished: bool

    @classmethod
    def parse(cls, entry: object, workers: int) -> "ItemRange":
        if not isinstance(entry, dict):
            raise LedgerError(f"a work report entry must be an object, got {type(entry).__name__}")
        try:
            worker, item, pass_ = int(entry["worker"]), int(entry["item"]), int(entry["pass"])
            start, end = [int(v) for v in entry["start"]], [int(v) for v in entry["end"]]
            finished = entry["finished"]
        except (KeyError, TypeError, ValueError) as e:
            raise LedgerError(f"malformed work report entry {str(entry)[:120]}: {e}") from None
        if not isinstance(finished, bool) or not 0 <= worker < workers or len(start) > 8 or len(end) > 8:
            raise LedgerError(f"work report entry out of range: {str(entry)[:120]}")
        return cls(worker, item, pass_, start, end, finished)


def parse_report(report: object, workers: int) -> dict[str, list[ItemRange]]:
    """{kind: [ranges]} from a vote's `consumed` field, checked for shape and size."""
    if report is None:
        return {}
    if not isinstance(report, dict) or not all(isinstance(k, str) and isinstance(v, list) for k, v in report.items()):
        raise LedgerError("a work report maps each kind of work to a list of ranges")
    if sum(len(v) for v in report.values()) > _MAX_REPORT_ENTRIES:
        raise LedgerError(f"a work report holds at most {_MAX_REPORT_ENTRIES} entries")
    return {kind: [ItemRange.parse(e, workers) for e in entries] for kind, entries in report.items()}


class WorkLedger:
    """The items of one kind of work. Runs inside the coordinator's transactions (callers hold its
    lock and open the transaction)."""

    def __init__(self, db, kind: str) -> None:
        self.db, self.kind = db, kind

    @property
    def items(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM work_items WHERE kind = ?", (self.kind,)).fetchone()[0]

    def configure(self, items: int) -> None:
        """Creates the item rows once, when the first node that takes this kind of work joins."""
        if self.items == 0 and items > 0:
            self.db.executemany("INSERT INTO work_items VALUES (?, ?, 0, '[]', NULL, NULL, NULL)",
                                [(self.kind, i) for i in range(items)])

    def lease(self, node_id: str, worker: int, held: list[int], sticky: str = "", share: int | None = None) -> dict:
        """A free item for one worker: one this worker (`sticky`: node name / local rank) took before, if
        free (a resumed or restarted node goes on where it left off, and a resumed run repeats itself
        exactly), else a begun one, else the one with the fewest passes, lowest index first. `held` lists
        the items the worker knows it holds: one leased to it that it does not list is an answer that got
        lost on the way (a retried request), and is answered again instead of leasing another.

        `share`: a spare item (the worker consumes several at once and holds one already), granted only
        while the worker holds fewer than `share` items (or if it is one the worker had begun); otherwise,
        or when none is free, the answer's item is None."""
        lost = self.db.execute("SELECT item, pass, cursor FROM work_items WHERE kind = ? AND holder = ? AND worker = ? "
                               "ORDER BY item", (self.kind, node_id, worker)).fetchall()
        for row in lost:
            if row[0] not in held:
                return {"kind": self.kind, "item": row[0], "pass": row[1], "cursor": json.loads(row[2])}
        # A worker that consumes several items at once gets back, after a restart, the ones it had begun
        # (its own with a cursor past the top), whatever its share: a resumed run repeats itself.
        row = self.db.execute("SELECT item, pass, cursor FROM work_items WHERE kind = ? AND holder IS NULL "
                              "AND sticky = ? AND cursor != '[]' ORDER BY pass, item LIMIT 1",
                              (self.kind, sticky)).fetchone() if sticky else None
        if row is None and share is not None and len(lost) >= share:
            return {"kind": self.kind, "item": None}
        # Otherwise begun items first (e.g. released by a node that died), then the fewest passes.
        row = row or self.db.execute(
            "SELECT item, pass, cursor FROM work_items WHERE kind = ? AND holder IS NULL ORDER BY CASE WHEN sticky = ? "
            "THEN 0 ELSE 1 END, CASE WHEN cursor != '[]' THEN 0 ELSE 1 END, pass, item LIMIT 1",
            (self.kind, sticky)).fetchone()
        if row is None and share is not None:
            return {"kind": self.kind, "item": None}
        if row is None:
            raise LedgerError(f"all {self.items} {self.kind} items are leased to other workers; cut the work into "
                              "more items than the run has local ranks in all nodes together")
        self.db.execute("UPDATE work_items SET holder = ?, worker = ?, sticky = ? WHERE kind = ? AND item = ?",
                        (node_id, worker, sticky or None, self.kind, row[0]))
        return {"kind": self.kind, "item": row[0], "pass": row[1], "cursor": json.loads(row[2])}

    def release(self, node_id: str) -> int:
        """A node that died or left: its items go back to the pool at their committed cursors."""
        return self.db.execute("UPDATE work_items SET holder = NULL, worker = NULL WHERE kind = ? AND holder = ?",
                               (self.kind, node_id)).rowcount

    def check(self, node_id: str, ranges: list[ItemRange]) -> str | None:
        """Why `ranges` cannot be committed for node_id, or None when every range starts at its item's
        committed cursor, in a pass and an item the node holds."""
        for r in ranges:
            row = self.db.execute("SELECT pass, cursor, holder FROM work_items WHERE kind = ? AND item = ?",
                                  (self.kind, r.item)).fetchone()
            if row is None:
                return f"{self.kind} item {r.item} does not exist (the run has {self.items})"
            if row[2] != node_id:
                return f"{self.kind} item {r.item} is not leased to this node"
            if row[0] != r.pass_ or json.loads(row[1]) != r.start:
                return (f"{self.kind} item {r.item} was consumed from pass {r.pass_} cursor {r.start}, but its "
                        f"committed position is pass {row[0]} cursor {json.loads(row[1])}")
        return None

    def commit(self, number: int, node_id: str, ranges: list[ItemRange]) -> None:
        """Round `number` counted these ranges: the cursors move (in the caller's transaction)."""
        for r in ranges:
            if r.finished:  # consumed to its end: the next pass starts from the top, taken by whoever leases it
                self.db.execute("UPDATE work_items SET pass = pass + 1, cursor = '[]', holder = NULL, worker = NULL "
                                "WHERE kind = ? AND item = ?", (self.kind, r.item))
            else:
                self.db.execute("UPDATE work_items SET cursor = ? WHERE kind = ? AND item = ?",
                                (json.dumps(r.end), self.kind, r.item))
            self.db.execute("INSERT INTO work_log (round, kind, node_id, worker, item, pass, start, end, finished) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", (number, self.kind, node_id, r.worker, r.item, r.pass_,
                                                                   json.dumps(r.start), json.dumps(r.end), int(r.finished)))

    def roll_back(self, number: int) -> None:
        """The ledger as it was when round `number` committed (a whole-run resume from saved state):
        later ranges are forgotten, every item's pass and cursor recomputed from the log, all leases ended."""
        self.db.execute("DELETE FROM work_log WHERE kind = ? AND round > ?", (self.kind, number))
        for (item,) in self.db.execute("SELECT item FROM work_items WHERE kind = ?", (self.kind,)).fetchall():
            rows = self.db.execute("SELECT end, finished FROM work_log WHERE kind = ? AND item = ? ORDER BY id",
                                   (self.kind, item)).fetchall()
            passes = sum(f for _, f in rows)
            cursor = rows[-1][0] if rows and not rows[-1][1] else "[]"
            self.db.execute("UPDATE work_items SET pass = ?, cursor = ?, holder = NULL, worker = NULL "
                            "WHERE kind = ? AND item = ?", (passes, cursor, self.kind, item))

    def summary(self) -> dict:
        rows = self.db.execute("SELECT pass, holder FROM work_items WHERE kind = ?", (self.kind,)).fetchall()
        return {"items": len(rows), "leased": sum(1 for _, h in rows if h),
                "min_pass": min((p for p, _ in rows), default=0), "max_pass": max((p for p, _ in rows), default=0)}

    def log(self) -> list[dict]:
        rows = self.db.execute("SELECT round, node_id, worker, item, pass, start, end, finished FROM work_log "
                               "WHERE kind = ? ORDER BY id", (self.kind,)).fetchall()
        return [{"round": n, "node_id": nid, "worker": w, "item": i, "pass": p, "start": json.loads(a),
                 "end": json.loads(b), "finished": bool(f)} for n, nid, w, i, p, a, b, f in rows]


class WorkLedgers:
    """Every kind of work of a run, each kind made when the first node that takes it joins."""

    def __init__(self, db) -> None:
        self.db = db

    def kinds(self) -> list[str]:
        return [k for (k,) in self.db.execute("SELECT DISTINCT kind FROM work_items ORDER BY kind")]

    def __getitem__(self, kind: str) -> WorkLedger:
        return WorkLedger(self.db, kind)

    def release(self, node_id: str) -> None:
        for kind in self.kinds():
            self[kind].release(node_id)

    def check(self, node_id: str, consumed: dict[str, list[ItemRange]]) -> str | None:
        known = set(self.kinds())
        for kind, ranges in consumed.items():
            if ranges and kind not in known:
                return f"this run hands out no {kind!r} work (it has: {sorted(known)})"
            if ranges and (why := self[kind].check(node_id, ranges)):
                return why
        return None

    def commit(self, number: int, node_id: str, consumed: dict[str, list[ItemRange]]) -> None:
        for kind, ranges in consumed.items():
            self[kind].commit(number, node_id, ranges)

    def roll_back(self, number: int) -> None:
        for kind in self.kinds():
            self[kind].roll_back(number)

    def summary(self) -> dict:
        return {kind: self[kind].summary() for kind in self.kinds()}
