"""The coordinator's durable state in SQLite: run, nodes, round decisions, rendezvous entries, events,
the work ledgers (see leases.py) and the dashboard's telemetry.

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
    state TEXT NOT NULL, joined_at REAL NOT NULL, round INTEGER NOT NULL, state_hash TEXT NOT NULL,
    address TEXT NOT NULL, contributions INTEGER NOT NULL DEFAULT 0, refused INTEGER NOT NULL DEFAULT 0,
    needs_resync INTEGER NOT NULL DEFAULT 0, servers TEXT NOT NULL DEFAULT '[]', token_id TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS tokens (token_id TEXT PRIMARY KEY, role TEXT NOT NULL, max_nodes INTEGER NOT NULL,
    expires_at REAL NOT NULL, created_at REAL NOT NULL, revoked_at REAL);
CREATE TABLE IF NOT EXISTS rounds (
    round INTEGER NOT NULL, attempt INTEGER NOT NULL, epoch INTEGER NOT NULL, members TEXT NOT NULL,
    decision TEXT NOT NULL, state_hash TEXT, decided_at REAL NOT NULL, allreduce_s REAL,
    PRIMARY KEY (round, attempt));
CREATE TABLE IF NOT EXISTS commits (
    round INTEGER NOT NULL, node_id TEXT NOT NULL, state_hash TEXT NOT NULL, PRIMARY KEY (round, node_id));
CREATE TABLE IF NOT EXISTS store (key TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS events (id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, text TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS work_items (kind TEXT NOT NULL, item INTEGER NOT NULL, pass INTEGER NOT NULL,
    cursor TEXT NOT NULL, holder TEXT, worker INTEGER, sticky TEXT, PRIMARY KEY (kind, item));
CREATE TABLE IF NOT EXISTS work_log (id INTEGER PRIMARY KEY AUTOINCREMENT, round INTEGER NOT NULL, kind TEXT NOT NULL,
    node_id TEXT NOT NULL, worker INTEGER NOT NULL, item INTEGER NOT NULL, pass INTEGER NOT NULL, start TEXT NOT NULL,
    end TEXT NOT NULL, finished INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS strikes (id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, token_id TEXT NOT NULL,
    node TEXT NOT NULL, kind TEXT NOT NULL, why TEXT NOT NULL);
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
    round: int  # the last committed round whose state the node holds
    state_hash: str
    address: str
    contributions: int = 0
    refused: int = 0
    needs_resync: int = 0
    servers: str = "[]"  # JSON list of host:port, the transfer server of each local rank
    token_id: str = ""  # the join token that admitted it (its cap, its vote, its revocation)


@dataclass
class RoundDecision:
    round: int
    attempt: int
    epoch: int
    members: list[dict]  # [{node_id, name, contributes}] in rank order
    decision: str  # open | apply | abort
    state_hash: str | None = None


class CoordinatorState:
    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        if self.db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'steps'").fetchone():
            raise ValueError(f"{path} was written by a coordinator before 0.2 (its tables speak of steps, not rounds); "
                             "finish that run with the version that started it, or start a new --state-dir")
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
        self.db.execute(f"INSERT OR REPLACE INTO nodes ({_NODE_COLUMNS}) VALUES ({','.join('?' * 14)})",
                        tuple(node.__dict__.values()))

    # rounds
    def put_round(self, decision: RoundDecision, allreduce_s: float | None = None) -> None:
        # Later writes (the commit's majority hash) keep the decision's time and all-reduce time.
        self.db.execute("INSERT INTO rounds VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (round, attempt) DO UPDATE "
                        "SET epoch = excluded.epoch, members = excluded.members, decision = excluded.decision, "
                        "state_hash = excluded.state_hash, allreduce_s = COALESCE(excluded.allreduce_s, "
                        "rounds.allreduce_s), decided_at = CASE WHEN rounds.decision = excluded.decision "
                        "THEN rounds.decided_at ELSE excluded.decided_at END",
                        (decision.round, decision.attempt, decision.epoch, json.dumps(decision.members),
                         decision.decision, decision.state_hash, time.time(), allreduce_s))

    def rounds(self, number: int | None = None) -> list[RoundDecision]:
        rows = self.db.execute(_ROUND_QUERY + (" WHERE round = ?" if number is not None else "") +
                               " ORDER BY round, attempt", (() if number is None else (number,)))
        return [_decision(r) for r in rows]

    def open_rounds(self) -> list[RoundDecision]:
        return [_decision(r) for r in self.db.execute(_ROUND_QUERY + " WHERE decision = 'open'")]

    def last_round(self) -> RoundDecision | None:
        row = self.db.execute(_ROUND_QUERY + " ORDER BY round DESC, attempt DESC LIMIT 1").fetchone()
        return _decision(row) if row else None

    def max_epoch(self) -> int:
        return self.db.execute("SELECT COALESCE(MAX(epoch), 0) FROM rounds").fetchone()[0]

    def committed_hashes(self, limit: int) -> dict[int, str]:
        """The majority state hash of the last `limit` applied rounds."""
        rows = self.db.execute("SELECT round, state_hash FROM rounds WHERE decision = 'apply' AND state_hash "
                               "IS NOT NULL ORDER BY round DESC LIMIT ?", (limit,)).fetchall()
        return {number: h for number, h in rows}

    def epoch_decision(self, epoch: int) -> str | None:
        row = self.db.execute("SELECT decision FROM rounds WHERE epoch = ? ORDER BY round DESC, attempt DESC "
                              "LIMIT 1", (epoch,)).fetchone()
        return row[0] if row else None

    def epoch_members(self, epoch: int) -> list[dict]:
        """The members, in rank order, of the newest attempt that formed or reused `epoch` ([] if none)."""
        row = self.db.execute("SELECT members FROM rounds WHERE epoch = ? ORDER BY round DESC, attempt DESC LIMIT 1",
                              (epoch,)).fetchone()
        return json.loads(row[0]) if row else []

    def committed_round(self) -> int:
        row = self.db.execute("SELECT MAX(round) FROM rounds WHERE decision = 'apply'").fetchone()
        return row[0] or 0

    def round_summaries(self, limit: int = 50) -> list[dict]:
        """The last `limit` attempts, oldest first."""
        rows = self.db.execute("SELECT round, attempt, epoch, members, decision, state_hash, decided_at, "
                               "allreduce_s FROM rounds ORDER BY round DESC, attempt DESC LIMIT ?", (limit,))
        return [{"round": r[0], "attempt": r[1], "epoch": r[2], "members": [m["name"] for m in json.loads(r[3])],
                 "decision": r[4], "state_hash": r[5], "decided_at": r[6], "allreduce_s": r[7]} for r in rows][::-1]

    # commits (state hashes per node)
    def put_commit(self, number: int, node_id: str, state_hash: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO commits VALUES (?, ?, ?)", (number, node_id, state_hash))

    def roll_back(self, number: int) -> None:
        """Rounds applied after round `number` become `rolled_back` and their commits are forgotten: the
        run resumes from nodes' saved state of that round. The first round after it waits for start_nodes."""
        self.db.execute("UPDATE rounds SET decision = 'rolled_back' WHERE round > ? AND decision = 'apply'",
                        (number,))
        self.db.execute("DELETE FROM commits WHERE round > ?", (number,))
        self.set_meta("resumed_at", number)

    def commits(self, number: int) -> dict[str, str]:
        return dict(self.db.execute("SELECT node_id, state_hash FROM commits WHERE round = ?", (number,)))

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

    # tokens (made by `token create`, revoked by `token revoke`; both may run while the coordinator does)
    def put_token(self, token_id: str, role: str, max_nodes: int, expires_at: float) -> None:
        self.db.execute("INSERT OR IGNORE INTO tokens VALUES (?, ?, ?, ?, ?, NULL)",
                        (token_id, role, max_nodes, expires_at, time.time()))

    def revoke_token(self, token_id: str) -> bool:
        """Marks a known token revoked; False if no token of this run has that id."""
        return self.db.execute("UPDATE tokens SET revoked_at = COALESCE(revoked_at, ?) WHERE token_id = ?",
                               (time.time(), token_id)).rowcount > 0

    def token_revoked(self, token_id: str) -> bool:
        row = self.db.execute("SELECT revoked_at FROM tokens WHERE token_id = ?", (token_id,)).fetchone()
        return row is not None and row[0] is not None

    def tokens(self) -> list[dict]:
        rows = self.db.execute("SELECT token_id, role, max_nodes, expires_at, created_at, revoked_at FROM tokens "
                               "ORDER BY created_at").fetchall()
        return [dict(zip(("token_id", "role", "max_nodes", "expires_at", "created_at", "revoked_at"), r)) for r in rows]

    # events
    # strikes (coordinator/strikes.py): what a token's nodes did that cost the others an attempt
    def add_strike(self, token_id: str, node: str, kind: str, why: str) -> int:
        """Records a strike against `token_id`; its number of strikes now."""
        self.db.execute("INSERT INTO strikes (time, token_id, node, kind, why) VALUES (?, ?, ?, ?, ?)",
                        (time.time(), token_id, node, kind, why))
        return self.strikes_of(token_id)

    def strikes_of(self, token_id: str) -> int:
        return self.db.execute("SELECT COUNT(*) FROM strikes WHERE token_id = ?", (token_id,)).fetchone()[0]

    def strikes(self, limit: int = 50) -> list[dict]:
        rows = self.db.execute("SELECT time, token_id, node, kind, why FROM strikes ORDER BY id DESC LIMIT ?",
                               (limit,)).fetchall()
        return [dict(zip(("time", "token_id", "node", "kind", "why"), r)) for r in reversed(rows)]

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


_ROUND_QUERY = "SELECT round, attempt, epoch, members, decision, state_hash FROM rounds"


def _decision(row) -> RoundDecision:
    return RoundDecision(row[0], row[1], row[2], json.loads(row[3]), row[4], row[5])


_NODE_COLUMNS = ("node_id, name, session_hash, node_index, state, joined_at, round, state_hash, address, "
                 "contributions, refused, needs_resync, servers, token_id")


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self):
        self.db.execute("BEGIN IMMEDIATE")
        return self

    def __exit__(self, exc_type, *_):
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")
