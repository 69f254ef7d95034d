"""The coordinator's decisions: leases, the members of each outer step, votes, commits (admission: admission.py).

All methods are called from HTTP handler threads under one lock; long-polls wait on its condition.
Leases are timed on this process's monotonic clock only: no wall clocks are compared across machines.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import statistics
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass

from elastic_mesh.coordinator.admission import Admission, hash_session
from elastic_mesh.coordinator.config import CoordinatorConfig, Refused
from elastic_mesh.coordinator.leases import DataLedger, LedgerError, parse_report
from elastic_mesh.coordinator.state import CoordinatorState, Node, StepDecision
from elastic_mesh.coordinator.telemetry import TelemetryLog
from elastic_mesh.control.token import TokenError, verify_token

log = logging.getLogger(__name__)


@dataclass
class Ready:
    at: float
    contributes: bool


class Coordinator(Admission):
    def __init__(self, state: CoordinatorState, secret: bytes, run_id: str, config: CoordinatorConfig,
                 address: str) -> None:
        self.state, self.secret, self.run_id, self.config, self.address = state, secret, run_id, config, address
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.leases: dict[str, float] = {}
        self.ready: dict[int, dict[str, Ready]] = defaultdict(dict)
        self.first_ready: dict[int, float] = {}
        self.votes: dict[tuple[int, int], dict[str, dict]] = defaultdict(dict)
        self.round_times: deque[float] = deque(maxlen=20)
        self.last_ready_at: dict[str, float] = {}
        self.expected: dict[str, int] = {}  # node_id -> the outer step a node still catching up will be back for
        self.started = time.monotonic()
        self.heard_from: set[str] = set()  # nodes that made a request to this process (not just in the state)
        self.telemetry = TelemetryLog(state)
        self.ledger = DataLedger(state.db)
        with self.state.transaction():
            self.state.set_meta("run_id", run_id)
            if self.state.get_meta("snapshot_key") is None:
                # Admitted nodes present it to each other to fetch snapshots; tokens never leave the coordinator.
                self.state.set_meta("snapshot_key", secrets.token_hex(24))
            # Whatever was in flight when the previous process died is re-run from scratch; nothing was
            # applied, since nodes apply only after an "apply" decision, which is always written first.
            for step in self.state.open_steps():
                step.decision = "abort"
                self.state.put_step(step)
            restarted = bool(self.state.nodes())
            if restarted:
                self.state.event("coordinator restarted; nodes keep their sessions")
        now = time.monotonic()
        for node in self.state.nodes():
            if node.state == "active":
                self.leases[node.node_id] = now + config.lease_s * 2  # grace for nodes to reconnect

    def may_read_status(self, authorization: str, node_id: str, session: str) -> bool:
        if self.config.public_status:
            return True
        if authorization.startswith("Bearer "):
            try:
                verify_token(self.secret, self.run_id, authorization[7:])
                return True
            except TokenError:
                return False
        node = self.state.node(node_id) if node_id else None
        return node is not None and hmac.compare_digest(node.session_hash, hash_session(session or ""))

    def authenticate(self, node_id: str, session: str) -> Node:
        """The node making a request, or Refused. Every request but join and status goes through here."""
        node = self.state.node(node_id) if node_id else None
        if node is None or not hmac.compare_digest(node.session_hash, hash_session(session or "")):
            raise Refused(401, "unknown node or wrong session; join again with a valid token")
        if node.state != "active":
            raise Refused(410, f"{node.name} was declared {node.state}; join again to continue")
        self.heard_from.add(node.node_id)
        return node

    def heartbeat(self, node: Node, body: dict) -> dict:
        with self.lock:
            self._expire_leases()
            if self.state.node(node.node_id).state != "active":
                raise Refused(410, f"{node.name} was declared dead; join again to continue")
            self.leases[node.node_id] = time.monotonic() + self.config.lease_s
            self.telemetry.received(node.node_id, body.get("telemetry"), time.time())
        return {"committed_step": self.state.committed_step()}

    def leave(self, node: Node) -> dict:
        with self.lock, self.state.transaction():
            node.state = "left"
            self.state.put_node(node)
            self.leases.pop(node.node_id, None)
            self.ledger.release(node.node_id)
            self.state.event(f"{node.name} left")
            self.changed.notify_all()
        log.info("%s left", node.name)
        return {"ok": True}

    def _expire_leases(self) -> None:
        now = time.monotonic()
        expired = [n for n, until in self.leases.items() if until < now]
        for node_id in expired:
            del self.leases[node_id]
            node = self.state.node(node_id)
            if node and node.state == "active":
                with self.state.transaction():
                    node.state = "dead"
                    self.state.put_node(node)
                    self.ledger.release(node.node_id)  # its uncommitted reading goes back to the pool
                    self.state.event(f"{node.name} declared dead (no heartbeat for {self.config.lease_s:g} s)")
                log.warning("%s declared dead: no heartbeat for %.1f s", node.name, self.config.lease_s)
        if expired:
            self.changed.notify_all()

    def live_nodes(self) -> list[Node]:
        return [n for n in self.state.nodes() if n.state == "active" and n.node_id in self.leases]

    # ---- the outer-step barrier ----------------------------------------------------------------------
    def declare_ready(self, node: Node, body: dict) -> dict | None:
        """Answers go/missed/resync, or None while the members of the step are not fixed yet."""
        step = int(body["outer_step"])
        committed = self.state.committed_step()
        if node.needs_resync:
            return {"status": "resync", "committed_step": committed}
        if step <= committed:
            return {"status": "missed", "committed_step": committed}
        if step > committed + 1:
            raise Refused(409, f"outer step {step} is ahead of the run (last committed {committed})")
        open_step = self._open_attempt(step)
        if open_step is not None:
            for rank, member in enumerate(open_step.members):
                if member["node_id"] == node.node_id:
                    return self._go(open_step, rank)
            return None  # a latecomer waits for the attempt in flight to end
        if node.node_id not in self.ready[step]:
            now = time.monotonic()
            self.ready[step][node.node_id] = Ready(now, bool(body.get("contributes", True)))
            self.first_ready.setdefault(step, now)
            if node.node_id in self.last_ready_at:
                self.round_times.append(now - self.last_ready_at[node.node_id])
            self.last_ready_at[node.node_id] = now
        self._try_fix_members(step)
        open_step = self._open_attempt(step)
        if open_step is not None:
            return self.declare_ready(node, body)
        return None

    def will_join(self, node: Node, body: dict) -> dict:
        """A node catching up names the outer step it will be back for. That step's barrier waits for it
        as for a node holding the step before (up to the deadline): otherwise a node that replays the
        newest step just as the others launch the next (streaming launches one every H/F inner steps)
        commits a moment after that step's members were fixed and is left out of it, over and over."""
        step = int(body["outer_step"])
        with self.lock:
            committed = self.state.committed_step()
            if step > committed + 2:
                raise Refused(409, f"outer step {step} is more than one step after the one in flight "
                                   f"(last committed {committed}); a node can only say it will be back for "
                                   f"the step after the next")
            if step <= committed or self._open_attempt(step) is not None:
                return {"status": "missed", "committed_step": committed}
            self.expected[node.node_id] = step
            return {"status": "ok", "committed_step": committed}

    def deadline_s(self) -> float:
        measured = statistics.median(self.round_times) if self.round_times else 0.0
        return max(self.config.min_wait_s, self.config.deadline_factor * measured)

    def _open_attempt(self, step: int) -> StepDecision | None:
        attempts = self.state.steps(step)
        return attempts[-1] if attempts and attempts[-1].decision == "open" else None

    def _try_fix_members(self, step: int) -> None:
        self._expire_leases()
        live = {n.node_id: n for n in self.live_nodes()}
        ready = {nid: r for nid, r in self.ready[step].items() if nid in live}
        if not ready:
            return
        waited = time.monotonic() - self.first_ready.get(step, time.monotonic())
        # Only nodes that hold the last committed state are waited for; one still catching up (a joiner
        # fetching a snapshot, a straggler replaying) never holds the others back.
        in_step = {nid for nid, n in live.items() if not n.needs_resync
                   and (n.outer_step == step - 1 or self.expected.get(nid) == step)}
        if not in_step <= set(ready) and waited < self.deadline_s():
            return
        # The first step, and the first after a whole-run resume, waits for start_nodes (not the first to arrive).
        first = step == 1 or step == int(self.state.get_meta("resumed_at", "-1")) + 1
        if first and len(ready) < self.config.start_nodes:
            return
        if not any(r.contributes for r in ready.values()):
            return
        members = sorted(ready, key=lambda nid: live[nid].node_index)
        attempts = self.state.steps(step)
        last = self.state.last_step()
        same = last is not None and last.decision == "apply" and [m["node_id"] for m in last.members] == members
        epoch = last.epoch if same else self.state.max_epoch() + 1
        decision = StepDecision(step, len(attempts) + 1, epoch, [
            {"node_id": nid, "name": live[nid].name, "contributes": ready[nid].contributes} for nid in members], "open")
        late = [live[nid].name for nid in in_step if nid not in ready]
        with self.state.transaction():
            self.state.put_step(decision)
            if not same:
                self.state.store_drop_before_epoch(epoch)
                self.state.event(f"epoch {epoch}: {len(members)} nodes ({', '.join(m['name'] for m in decision.members)})")
            if late:
                self.state.event(f"outer step {step}: left out late node(s) {', '.join(late)} after {waited:.1f} s")
        self.ready.pop(step, None)
        self.first_ready.pop(step, None)
        self.expected = {nid: s for nid, s in self.expected.items() if s > step}
        log.info("outer step %d attempt %d: epoch %d with %d node(s)%s", step, decision.attempt, epoch,
                 len(members), f", without late {', '.join(late)}" if late else "")
        self.changed.notify_all()

    def _go(self, step: StepDecision, rank: int) -> dict:
        return {"status": "go", "outer_step": step.outer_step, "attempt": step.attempt, "epoch": step.epoch,
                "rank": rank, "world_size": len(step.members), "members": step.members}

    # ---- votes and commits ---------------------------------------------------------------------------
    def vote(self, node: Node, body: dict) -> dict | None:
        step, attempt = int(body["outer_step"]), int(body["attempt"])
        decided = next((s for s in self.state.steps(step) if s.attempt == attempt), None)
        if decided is None:
            raise Refused(404, f"outer step {step} attempt {attempt} was never decided")
        if decided.decision != "open":
            return {"decision": decided.decision}
        try:
            data = parse_report(body.get("data"), int(self.state.get_meta("procs_per_node", "1")))
            wrong = self.ledger.check(node.node_id, data)
        except LedgerError as e:
            wrong = str(e)
        if wrong:
            # Honest nodes only report what they leased; this is a bug or a forgery, never averaged data lost
            # silently: the node's vote is refused, the attempt aborts when its lease runs out.
            raise Refused(400, f"data report refused: {wrong}")
        votes = self.votes[(step, attempt)]
        votes[node.node_id] = {"ok": bool(body.get("ok")), "refused": dict(body.get("refused") or {}),
                               "blame": list(body.get("blame") or []), "allreduce_s": body.get("allreduce_s"),
                               "data": data}
        self._expire_leases()
        members = [m["node_id"] for m in decided.members]
        failed = [nid for nid, v in votes.items() if not v["ok"]]
        gone = [nid for nid in members if nid not in self.leases and nid not in votes]
        if failed or gone:
            self._decide(decided, "abort", votes)
        elif all(nid in votes for nid in members):
            self._decide(decided, "apply", votes)
        else:
            return None
        return {"decision": self.state.steps(step)[attempt - 1].decision}

    def _decide(self, step: StepDecision, decision: str, votes: dict[str, dict]) -> None:
        names = {m["node_id"]: m["name"] for m in step.members}
        blamed = {b for v in votes.values() for b in v["blame"] if b in names}
        refused = {nid: why for v in votes.values() for nid, why in v["refused"].items() if nid in names}
        times = [v["allreduce_s"] for v in votes.values() if isinstance(v.get("allreduce_s"), (int, float))]
        with self.state.transaction():
            step.decision = decision
            self.state.put_step(step, allreduce_s=max(times) if times else None)
            for nid, why in refused.items():
                node = self.state.node(nid)
                node.refused += 1
                self.state.put_node(node)
                self.state.event(f"outer step {step.outer_step}: refused {names[nid]}'s pseudo-gradient ({why})")
            for nid in blamed:
                node = self.state.node(nid)
                node.state = "evicted"
                self.state.put_node(node)
                self.leases.pop(nid, None)
                self.ledger.release(nid)
                self.state.event(f"outer step {step.outer_step}: evicted {names[nid]} (sent invalid data)")
            if decision == "apply":
                for m in step.members:  # every member applies the mean, refused or not
                    node = self.state.node(m["node_id"])
                    node.outer_step = step.outer_step
                    if m["contributes"] and m["node_id"] not in refused:
                        node.contributions += 1
                        # Its data entered this average: the cursors move in the same transaction.
                        self.ledger.commit(step.outer_step, node.node_id, votes.get(node.node_id, {}).get("data", []))
                    self.state.put_node(node)
            else:
                failed = [names[n] for n, v in votes.items() if not v["ok"]]
                self.state.event(f"outer step {step.outer_step} attempt {step.attempt} aborted "
                                 f"(failed: {', '.join(failed) or 'a member vanished'}); retrying")
        log.info("outer step %d attempt %d: %s", step.outer_step, step.attempt, decision)
        self.votes.pop((step.outer_step, step.attempt), None)
        self.changed.notify_all()

    def commit(self, node: Node, body: dict) -> dict:
        step, model_hash = int(body["outer_step"]), str(body["model_hash"])[:64]
        applied = [s for s in self.state.steps(step) if s.decision == "apply"]
        if not applied:
            raise Refused(409, f"outer step {step} was not applied; nothing to commit")
        with self.lock, self.state.transaction():
            self.state.put_commit(step, node.node_id, model_hash)
            node = self.state.node(node.node_id)
            node.model_hash, node.needs_resync = model_hash, 0
            self.state.put_node(node)
            hashes = self.state.commits(step)
            members = {m["node_id"]: m for m in applied[-1].members}
            counts: dict[str, int] = defaultdict(int)
            for h in hashes.values():
                counts[h] += 1
            majority = max(counts, key=lambda h: (counts[h], -min(
                self.state.node(n).node_index for n, x in hashes.items() if x == h)))
            if model_hash == majority and node.outer_step < step:
                node.outer_step = step  # a node that caught up by replaying now holds this step
                self.state.put_node(node)
            step_row = applied[-1]
            step_row.model_hash = majority
            self.state.put_step(step_row)
            diverged = [n for n, h in hashes.items() if h != majority and n in members]
            for nid in diverged:
                bad = self.state.node(nid)
                if not bad.needs_resync:
                    bad.needs_resync = 1
                    self.state.put_node(bad)
                    self.state.event(f"outer step {step}: {bad.name} diverged (hash {hashes[nid]} != {majority}); "
                                     "it will resync from a peer")
                    log.warning("%s diverged at outer step %d; it will resync", bad.name, step)
        return {"status": "diverged" if node.node_id in diverged else "ok", "majority_hash": majority}

    def tick(self) -> None:
        """Runs every fraction of a second: expires leases and fixes members whose deadline passed."""
        with self.lock:
            self._expire_leases()
            for step in list(self.ready):
                self._try_fix_members(step)
            for (step, attempt), votes in list(self.votes.items()):
                decided = self.state.steps(step)
                current = next((s for s in decided if s.attempt == attempt), None)
                if current and current.decision == "open":
                    gone = [m["node_id"] for m in current.members
                            if m["node_id"] not in self.leases and m["node_id"] not in votes]
                    if gone:
                        self._decide(current, "abort", votes)
            for step in self.state.open_steps():
                # A member that died before voting (even before anyone voted: in the rendezvous or the
                # state transfer) dooms the attempt; deciding now frees the others from waiting on it.
                votes = self.votes.get((step.outer_step, step.attempt), {})
                if any(m["node_id"] not in self.leases and m["node_id"] not in votes for m in step.members):
                    self._decide(step, "abort", votes)

    def lease_data(self, node: Node, body: dict) -> dict:
        """A free data shard for one worker (local rank) of `node`, with the cursor to read it from."""
        worker, held = int(body["worker"]), [int(s) for s in list(body.get("held") or [])[:4096]]
        procs = int(self.state.get_meta("procs_per_node", "1"))
        if not 0 <= worker < procs:
            raise Refused(400, f"worker {worker} is not a local rank of a {procs}-process node")
        with self.lock, self.state.transaction():
            if not self.ledger.shards:
                raise Refused(409, "this run has no data ledger: its nodes joined without data shards")
            try:
                lease = self.ledger.lease(node.node_id, worker, held, f"{node.name}/{worker}")
            except LedgerError as e:
                raise Refused(409, str(e)) from None
        log.debug("%s worker %d leased data shard %d (pass %d)", node.name, worker, lease["shard"], lease["pass"])
        return lease

    def epoch_is_dead(self, epoch: int) -> bool:
        """True once the newest attempt of the epoch aborted: its rendezvous will never complete."""
        return self.state.epoch_decision(epoch) == "abort"

    def sources(self, node: Node) -> dict:
        """Where a node that is behind can fetch the state: the live nodes holding the last committed
        step (their snapshot servers, one per local rank), and the committed hashes to check it against."""
        with self.lock:
            self._expire_leases()
            committed = self.state.committed_step()
            holders = [n for n in self.live_nodes() if n.outer_step == committed and not n.needs_resync
                       and n.node_id != node.node_id and json.loads(n.snapshot)]
            behind = [n.name for n in self.live_nodes() if n.outer_step < committed and n.node_id != node.node_id]
            return {"committed_step": committed, "hashes": self.state.committed_hashes(limit=64),
                    "sources": [{"name": n.name, "snapshot": json.loads(n.snapshot)} for n in holders],
                    "behind": behind}

    # ---- status ------------------------------------------------------------------------------------
    def history(self, after_id: int) -> dict:
        """Telemetry records after `after_id` and every outer-step attempt: what the dashboard plots."""
        with self.lock:
            names = {n.node_id: n.name for n in self.state.nodes()}
            return {**self.telemetry.history(after_id, names), "steps": self.state.step_summaries(limit=100_000),
                    "events": self.state.events(limit=500)}

    def status(self) -> dict:
        with self.lock:
            now = time.time()
            return {
                "run_id": self.run_id, "address": self.address,
                "epoch": self.state.max_epoch(),
                "committed_step": self.state.committed_step(),
                "deadline_s": round(self.deadline_s(), 2),
                "data": self.ledger.summary(),
                "nodes": [{"name": n.name, "node_index": n.node_index, "state": n.state,
                           "alive": n.node_id in self.leases, "address": n.address, "joined_at": n.joined_at,
                           "outer_step": n.outer_step, "contributions": n.contributions, "refused": n.refused,
                           "model_hash": n.model_hash,
                           **self.telemetry.node_summary(n.node_id, now)} for n in self.state.nodes()],
                "steps": self.state.step_summaries(),
                "events": self.state.events(),
            }
