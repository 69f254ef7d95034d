"""The coordinator's durable state in SQLite: run, nodes, outer-step decisions, rendezvous entries, events,
the data ledger (see ledger.py) and the dashboard's telemetry.

Every method is one transaction. Nothing here knows about time-outs or leases; those live in memory.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY, name TEXT NOT NULL, session_hash TEXT NOT NULL, node_index INTEGER NOT NULL,
    state TEXT NOT NULL, joined_at REAL NOT NULL, outer_step INTEGER NOT NULL, model_hash TEXT NOT NULL,
    address TEXT NOT NULL, contributions INTEGER NOT NULL DEFAULT 0, refused INTEGER NOT NULL DEFAULT 0,
    needs_resync INTEGER NOT NULL DEFAULT 0, snapshot TEXT NOT NULL DEFAULT '[]');
CREATE TABLE IF NOT EXISTS steps (
    outer_step INTEGER NOT NULL, attempt INTEGER NOT NULL, epoch INTEGER NOT NULL, members TEXT NOT NULL,
    decision TEXT NOT NULL, model_hash TEXT, decided_at REAL NOT NULL, allreduce_s REAL,
    PRIMARY KEY (outer_step, attempt));
CREATE TABLE IF NOT EXISTS commits (
    outer_step INTEGER NOT NULL, node_id TEXT NOT NULL, model_hash TEXT NOT NULL, PRIMARY KEY (outer_step, node_id));
CREATE TABLE IF NOT EXISTS store (key TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, text TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS data_shards (shard INTEGER PRIMARY KEY, pass INTEGER NOT NULL, cursor TEXT NOT NULL,
    holder TEXT, worker INTEGER, sticky TEXT);
CREATE TABLE IF NOT EXISTS data_log (id INTEGER PRIMARY KEY AUTOINCREMENT, outer_step INTEGER NOT NULL,
    node_id TEXT NOT NULL, worker INTEGER NOT NULL, shard INTEGER NOT NULL, pass INTEGER NOT NULL, start TEXT NOT NULL,
    end TEXT NOT NULL, finished INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS telemetry (id INTEGER PRIMARY KEY AUTOINCREMENT, node_id TEXT NOT NULL, time REAL NOT NULL,
    record TEXT NOT NULL);
"""


@dataclass
class Node:
    node_id: str
    name: str
    session_hash: str
    node_index: int
    state: str  # active | left | dead | evicted
    joined_at: float
    outer_step: int
    model_hash: str
    address: str
    contributions: int = 0
    refused: int = 0
    needs_resync: int = 0
    snapshot: str = "[]"  # JSON list of host:port, the snapshot server of each local rank


@dataclass
class StepDecision:
    outer_step: int
    attempt: int
    epoch: int
    members: list[dict]  # [{node_id, name, contributes}] in rank order
    decision: str  # open | apply | abort
    model_hash: str | None = None


class CoordinatorState:
    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(_SCHEMA)

    def transaction(self):
        return _Transaction(self.db)

    # meta
    def get_meta(self, key: str, default: str | None = None) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def set_meta(self, key: str, value: object) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, str(value)))

    # nodes
    def nodes(self) -> list[Node]:
        return [Node(*row) for row in self.db.execute(f"SELECT {_NODE_COLUMNS} FROM nodes ORDER BY node_index")]

    def node(self, node_id: str) -> Node | None:
        row = self.db.execute(f"SELECT {_NODE_COLUMNS} FROM nodes WHERE node_id = ?", (node_id,)).fetchone()
        return Node(*row) if row else None

    def put_node(self, node: Node) -> None:
        self.db.execute(f"INSERT OR REPLACE INTO nodes ({_NODE_COLUMNS}) VALUES ({','.join('?' * 13)})",
                        tuple(node.__dict__.values()))

    # steps
    def put_step(self, step: StepDecision, allreduce_s: float | None = None) -> None:
        # Later writes (the commit's majority hash) keep the decision's time and all-reduce time.
        self.db.execute("INSERT INTO steps VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (outer_step, attempt) DO UPDATE "
                        "SET epoch = excluded.epoch, members = excluded.members, decision = excluded.decision, "
                        "model_hash = excluded.model_hash, allreduce_s = COALESCE(excluded.allreduce_s, "
                        "steps.allreduce_s), decided_at = CASE WHEN steps.decision = excluded.decision "
                        "THEN steps.decided_at ELSE excluded.decided_at END",
                        (step.outer_step, step.attempt, step.epoch, json.dumps(step.members), step.decision,
                         step.model_hash, time.time(), allreduce_s))

    def steps(self, outer_step: int | None = None) -> list[StepDecision]:
        rows = self.db.execute(_STEP_QUERY + (" WHERE outer_step = ?" if outer_step is not None else "") +
                               " ORDER BY outer_step, attempt", (() if outer_step is None else (outer_step,)))
        return [_step(r) for r in rows]

    def open_steps(self) -> list[StepDecision]:
        return [_step(r) for r in self.db.execute(_STEP_QUERY + " WHERE decision = 'open'")]

    def last_step(self) -> StepDecision | None:
        row = self.db.execute(_STEP_QUERY + " ORDER BY outer_step DESC, attempt DESC LIMIT 1").fetchone()
        return _step(row) if row else None

    def max_epoch(self) -> int:
        return self.db.execute("SELECT COALESCE(MAX(epoch), 0) FROM steps").fetchone()[0]

    def committed_hashes(self, limit: int) -> dict[int, str]:
        """The majority model hash of the last `limit` applied outer steps."""
        rows = self.db.execute("SELECT outer_step, model_hash FROM steps WHERE decision = 'apply' AND model_hash "
                               "IS NOT NULL ORDER BY outer_step DESC LIMIT ?", (limit,)).fetchall()
        return {step: h for step, h in rows}

    def epoch_decision(self, epoch: int) -> str | None:
        row = self.db.execute("SELECT decision FROM steps WHERE epoch = ? ORDER BY outer_step DESC, attempt DESC "
                              "LIMIT 1", (epoch,)).fetchone()
        return row[0] if row else None

    def committed_step(self) -> int:
        row = self.db.execute("SELECT MAX(outer_step) FROM steps WHERE decision = 'apply'").fetchone()
        return row[0] or 0

    def step_summaries(self, limit: int = 50) -> list[dict]:
        """The last `limit` attempts, oldest first."""
        rows = self.db.execute("SELECT outer_step, attempt, epoch, members, decision, model_hash, decided_at, "
                               "allreduce_s FROM steps ORDER BY outer_step DESC, attempt DESC LIMIT ?", (limit,))
        return [{"outer_step": r[0], "attempt": r[1], "epoch": r[2], "members": [m["name"] for m in json.loads(r[3])],
                 "decision": r[4], "model_hash": r[5], "decided_at": r[6], "allreduce_s": r[7]} for r in rows][::-1]

    # commits (model hashes per node)
    def put_commit(self, outer_step: int, node_id: str, model_hash: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO commits VALUES (?, ?, ?)", (outer_step, node_id, model_hash))

    def roll_back(self, outer_step: int) -> None:
        """Steps applied after `outer_step` become `rolled_back` and their commits are forgotten: the run
        resumes from nodes' checkpoints of that step. The first step after it waits for start_nodes."""
        self.db.execute("UPDATE steps SET decision = 'rolled_back' WHERE outer_step > ? AND decision = 'apply'",
                        (outer_step,))
        self.db.execute("DELETE FROM commits WHERE outer_step > ?", (outer_step,))
        self.set_meta("resumed_at", outer_step)

    def commits(self, outer_step: int) -> dict[str, str]:
        return dict(self.db.execute("SELECT node_id, model_hash FROM commits WHERE outer_step = ?", (outer_step,)))

    # rendezvous store
    def store_get(self, key: str) -> bytes | None:
        row = self.db.execute("SELECT value FROM store WHERE key = ?", (key,)).fetchone()
        return bytes(row[0]) if row else None

    def store_set(self, key: str, value: bytes) -> None:
        self.db.execute("INSERT OR REPLACE INTO store VALUES (?, ?)", (key, value))

    def store_drop_before_epoch(self, epoch: int) -> None:
        # Keys are "e{epoch}/..."; old epochs' rendezvous entries are never read again.
        for (key,) in self.db.execute("SELECT key FROM store").fetchall():
            if key.startswith("e") and key[1:].split("/", 1)[0].isdigit() and int(key[1:].split("/", 1)[0]) < epoch:
                self.db.execute("DELETE FROM store WHERE key = ?", (key,))

    # events
    def event(self, text: str) -> None:
        self.db.execute("INSERT INTO events (time, text) VALUES (?, ?)", (time.time(), text))

    def events(self, limit: int = 50) -> list[dict]:
        rows = self.db.execute("SELECT time, text FROM events ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        return [{"time": t, "text": x} for t, x in reversed(rows)]


    # telemetry (the dashboard's history; kept so a restarted coordinator still shows the whole run)
    def telemetry_add(self, node_id: str, records: list[dict]) -> None:
        now = time.time()
        self.db.executemany("INSERT INTO telemetry (node_id, time, record) VALUES (?, ?, ?)",
                            [(node_id, r.get("time", now), json.dumps(r)) for r in records])

    def telemetry_since(self, after_id: int, limit: int) -> list[tuple[int, str, dict]]:
        rows = self.db.execute("SELECT id, node_id, record FROM telemetry WHERE id > ? ORDER BY id LIMIT ?",
                               (after_id, limit)).fetchall()
        return [(i, n, json.loads(r)) for i, n, r in rows]


_STEP_QUERY = "SELECT outer_step, attempt, epoch, members, decision, model_hash FROM steps"


def _step(row) -> StepDecision:
    return StepDecision(row[0], row[1], row[2], json.loads(row[3]), row[4], row[5])


_NODE_COLUMNS = ("node_id, name, session_hash, node_index, state, joined_at, outer_step, model_hash, address, "
                 "contributions, refused, needs_resync, snapshot")


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self):
        self.db.execute("BEGIN IMMEDIATE")
        return self

    def __exit__(self, exc_type, *_):
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")
