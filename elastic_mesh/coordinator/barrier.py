"""The coordinator's side of a numbered round: who takes part (the barrier), whether every member
succeeded (the vote), and which state they all hold afterwards (the commit, by majority hash).

A member declares itself ready for round r; the coordinator fixes r's members among the live ones that
are ready, waiting for the others only up to a deadline derived from measured round times. Each member
then votes ok or not; one failure or vanished member aborts the attempt for all, and the round is
retried with the survivors. Applied, every member commits the hash of the state it now holds; a member
whose hash differs from the majority is told to resync. Every decision is written to the state in the
same transaction that makes it, before anyone is answered. Callers hold the coordinator's lock; long
polls wait on its condition.
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Protocol

from elastic_mesh.coordinator.config import CoordinatorConfig, Refused
from elastic_mesh.coordinator.leases import LedgerError, WorkLedgers, parse_report
from elastic_mesh.coordinator.rendezvous import RendezvousRules
from elastic_mesh.coordinator.state import CoordinatorState, Node, RoundDecision
from elastic_mesh.coordinator.strikes import Strikes

log = logging.getLogger(__name__)


class Members(Protocol):
    """What the barrier needs to know of the run's membership (coordinator/membership.py)."""

    work: WorkLedgers

    def expire(self) -> None: ...
    def live(self) -> list[Node]: ...
    def is_live(self, node_id: str) -> bool: ...
    def evict(self, node_id: str) -> None: ...


@dataclass
class Ready:
    at: float
    contributes: bool


class RoundBarrier:
    def __init__(self, state: CoordinatorState, config: CoordinatorConfig, members: Members,
                 lock: threading.RLock, changed: threading.Condition) -> None:
        self.state, self.config, self.members, self.lock, self.changed = state, config, members, lock, changed
        self.ready: dict[int, dict[str, Ready]] = defaultdict(dict)
        self.first_ready: dict[int, float] = {}
        self.votes: dict[tuple[int, int], dict[str, dict]] = defaultdict(dict)
        self.round_times: deque[float] = deque(maxlen=20)
        self.last_ready_at: dict[str, float] = {}
        self.expected: dict[str, int] = {}  # node_id -> the round a node still catching up will be back for
        self.rendezvous = RendezvousRules(state)
        self.strikes = Strikes(state, config, members)
        self.opened_at: dict[tuple[int, int], float] = {}  # (round, attempt) -> when its members were fixed
        self.barred: dict[int, set[str]] = defaultdict(set)  # round -> members struck in it: not in its retries
        self.present: dict[tuple[int, int], set[str]] = defaultdict(set)  # (round, attempt) -> members that came
        # Nodes a barrier waited the whole deadline for in vain: not waited for again until they are ready
        # within a deadline of a round's first ready node (or take part in one). Otherwise a node that
        # never comes, but commits each round's hash to look in step, costs every round the deadline.
        self.unwaited: set[str] = set()
        self.began: dict[int, float] = {}  # round -> when its first node was ready (kept after it is fixed)
        # Whatever was in flight when the previous process died is re-run from scratch; nothing was
        # applied, since members apply only after an "apply" decision, which is always written first.
        with state.transaction():
            for decision in state.open_rounds():
                decision.decision = "abort"
                state.put_round(decision)

    def declare_ready(self, node: Node, body: dict) -> dict | None:
        """Answers go/missed/resync, or None while the members of the round are not fixed yet."""
        number = int(body["round"])
        if node.node_id in self.unwaited and time.monotonic() - self.began.get(number, time.monotonic()) <= self.deadline_s():
            self.unwaited.discard(node.node_id)  # it would have made it: waited for again from the next round
        committed = self.state.committed_round()
        if node.needs_resync:
            return {"status": "resync", "committed_round": committed}
        if number <= committed or node.node_id in self.barred.get(number, ()):
            return {"status": "missed", "committed_round": committed}
        if number > committed + 1:
            raise Refused(409, f"round {number} is ahead of the run (last committed {committed})")
        open_round = self._open_attempt(number)
        if open_round is not None:
            for rank, member in enumerate(open_round.members):
                if member["node_id"] == node.node_id:
                    return self._go(open_round, rank)
            return None  # a latecomer waits for the attempt in flight to end
        if node.node_id not in self.ready[number]:
            now = time.monotonic()
            self.ready[number][node.node_id] = Ready(now, bool(body.get("contributes", True)))
            self.first_ready.setdefault(number, now)
            self.began.setdefault(number, now)
            if node.node_id in self.last_ready_at:
                self.round_times.append(now - self.last_ready_at[node.node_id])
            self.last_ready_at[node.node_id] = now
        self._try_fix_members(number)
        open_round = self._open_attempt(number)
        if open_round is not None:
            return self.declare_ready(node, body)
        return None

    def will_join(self, node: Node, body: dict) -> dict:
        """A node catching up names the round it will be back for. That round's barrier waits for it
        as for a node holding the round before (up to the deadline): otherwise a node that replays the
        newest round just as the others launch the next (streaming launches one every H/F inner steps)
        commits a moment after that round's members were fixed and is left out of it, over and over."""
        number = int(body["round"])
        with self.lock:
            committed = self.state.committed_round()
            if number > committed + 2:
                raise Refused(409, f"round {number} is more than one round after the one in flight "
                                   f"(last committed {committed}); a node can only say it will be back for "
                                   f"the round after the next")
            if number <= committed or self._open_attempt(number) is not None:
                return {"status": "missed", "committed_round": committed}
            self.expected[node.node_id] = number
            return {"status": "ok", "committed_round": committed}

    def deadline_s(self) -> float:
        measured = statistics.median(self.round_times) if self.round_times else 0.0
        return max(self.config.min_wait_s, self.config.deadline_factor * measured)

    def return_wait_s(self) -> float:
        """How long a round waits for a node back from a catch-up: one ordinary round (the median time
        between a member's ready and its next), never longer than the deadline."""
        return min(self.deadline_s(), statistics.median(self.round_times)) if self.round_times else self.deadline_s()

    def _open_attempt(self, number: int) -> RoundDecision | None:
        attempts = self.state.rounds(number)
        return attempts[-1] if attempts and attempts[-1].decision == "open" else None

    def _try_fix_members(self, number: int) -> None:
        self.members.expire()
        live = {n.node_id: n for n in self.members.live()}
        ready = {nid: r for nid, r in self.ready[number].items() if nid in live}
        if not ready:
            return
        waited = time.monotonic() - self.first_ready.get(number, time.monotonic())
        # Only nodes that hold the last committed state are waited for, up to the deadline; one still
        # catching up (a joiner fetching a snapshot, a straggler replaying) never holds the others back.
        # A node back from a catch-up (it said it would be back for this round, or caught up to the round
        # before by replaying it) is waited for one ordinary round at most: its last replay and first
        # inner steps must not cost the others more than that. If it misses, it catches up again.
        in_step = {nid for nid, n in live.items() if not n.needs_resync and nid not in self.barred.get(number, ())
                   and nid not in self.unwaited and (n.round == number - 1 or self.expected.get(nid) == number)}
        returning = {nid for nid in in_step if self.expected.get(nid) == number}
        late_holders, late_returning = (in_step - returning) - set(ready), returning - set(ready)
        if (late_holders and waited < self.deadline_s()) or (late_returning and waited < self.return_wait_s()):
            return
        # The first number, and the first after a whole-run resume, waits for start_nodes (not the first to arrive).
        first = number == 1 or number == int(self.state.get_meta("resumed_at", "-1")) + 1
        if first and len(ready) < self.config.start_nodes:
            return
        if not any(r.contributes for r in ready.values()):
            return
        members = sorted(ready, key=lambda nid: live[nid].node_index)
        attempts = self.state.rounds(number)
        last = self.state.last_round()
        same = last is not None and last.decision == "apply" and [m["node_id"] for m in last.members] == members
        epoch = last.epoch if same else self.state.max_epoch() + 1
        decision = RoundDecision(number, len(attempts) + 1, epoch, [
            {"node_id": nid, "name": live[nid].name, "contributes": ready[nid].contributes} for nid in members], "open")
        late = [live[nid].name for nid in in_step if nid not in ready]
        with self.state.transaction():
            self.state.put_round(decision)
            if not same:
                self.state.store_drop_before_epoch(epoch)
                self.state.event(f"epoch {epoch}: {len(members)} nodes ({', '.join(m['name'] for m in decision.members)})")
            if late:
                self.state.event(f"round {number}: left out late node(s) {', '.join(late)} after {waited:.1f} s")
        self.opened_at[(number, decision.attempt)] = time.monotonic()
        self.unwaited = (self.unwaited | {nid for nid in in_step - returning if nid not in ready}) - set(members)
        self.began = {n: t for n, t in self.began.items() if n >= number - 1}
        self.ready.pop(number, None)
        self.first_ready.pop(number, None)
        self.expected = {nid: s for nid, s in self.expected.items() if s > number}
        log.info("round %d attempt %d: epoch %d with %d node(s)%s", number, decision.attempt, epoch,
                 len(members), f", without late {', '.join(late)}" if late else "")
        self.changed.notify_all()

    def show_up(self, node: Node, body: dict) -> dict:
        """A member says it has begun the attempt it was given (before its rendezvous and transfer): the
        coordinator's own record of who showed up (strikes.py)."""
        number, attempt = int(body["round"]), int(body["attempt"])
        current = next((s for s in self.state.rounds(number) if s.attempt == attempt), None)
        if current is None or not any(m["node_id"] == node.node_id for m in current.members):
            raise Refused(409, f"{node.name} is not a member of round {number} attempt {attempt}")
        if current.decision == "open":
            self.present[(number, attempt)].add(node.node_id)
        return {"status": "ok", "decision": current.decision}

    def _go(self, current: RoundDecision, rank: int) -> dict:
        return {"status": "go", "round": current.round, "attempt": current.attempt, "epoch": current.epoch,
                "rank": rank, "world_size": len(current.members), "members": current.members}

    # ---- votes and commits ---------------------------------------------------------------------------
    def vote(self, node: Node, body: dict) -> dict | None:
        number, attempt = int(body["round"]), int(body["attempt"])
        decided = next((s for s in self.state.rounds(number) if s.attempt == attempt), None)
        if decided is None:
            raise Refused(404, f"round {number} attempt {attempt} was never decided")
        if decided.decision != "open":
            return {"decision": decided.decision}
        try:
            consumed = parse_report(body.get("consumed"), int(self.state.get_meta("procs_per_node", "1")))
            wrong = self.members.work.check(node.node_id, consumed)
        except LedgerError as e:
            wrong = str(e)
        votes = self.votes[(number, attempt)]
        if wrong:
            # Honest nodes only report what they leased; this is a bug or a forgery, never averaged data lost
            # silently: the node's vote is refused and it is struck; the others retry without it at once.
            self._strike_out(decided, {node.node_id: ("work report", wrong)}, votes)
            raise Refused(400, f"work report refused: {wrong}")
        votes[node.node_id] = {"ok": bool(body.get("ok")), "refused": dict(body.get("refused") or {}),
                               "blame": list(body.get("blame") or []), "allreduce_s": body.get("allreduce_s"),
                               "consumed": consumed,  # a long poll asks again: the first ask's time counts
                               "at": votes[node.node_id]["at"] if node.node_id in votes else time.monotonic()}
        self.members.expire()
        members = [m["node_id"] for m in decided.members]
        failed = [nid for nid, v in votes.items() if not v["ok"]]
        gone = [nid for nid in members if not self.members.is_live(nid) and nid not in votes]
        if failed or gone:
            self._decide(decided, "abort", votes)
        elif all(nid in votes for nid in members):
            self._decide(decided, "apply", votes)
        else:
            return None
        return {"decision": self.state.rounds(number)[attempt - 1].decision}

    def _decide(self, current: RoundDecision, decision: str, votes: dict[str, dict]) -> None:
        names = {m["node_id"]: m["name"] for m in current.members}
        blamed = {b for v in votes.values() for b in v["blame"] if b in names}
        refused = {nid: why for v in votes.values() for nid, why in v["refused"].items() if nid in names}
        times = [v["allreduce_s"] for v in votes.values() if isinstance(v.get("allreduce_s"), (int, float))]
        with self.state.transaction():
            current.decision = decision
            self.state.put_round(current, allreduce_s=max(times) if times else None)
            for nid, why in refused.items():
                node = self.state.node(nid)
                node.refused += 1
                self.state.put_node(node)
                self.state.event(f"round {current.round}: refused {names[nid]}'s contribution ({why})")
            for nid in blamed:
                self.members.evict(nid)
                self.state.event(f"round {current.round}: evicted {names[nid]} (sent invalid data)")
            if decision == "apply":
                for m in current.members:  # every member applies the mean, refused or not
                    node = self.state.node(m["node_id"])
                    node.round = current.round
                    if m["contributes"] and m["node_id"] not in refused:
                        node.contributions += 1
                        # Its data entered this average: the cursors move in the same transaction.
                        self.members.work.commit(current.round, node.node_id, votes.get(node.node_id, {}).get("consumed", {}))
                    self.state.put_node(node)
            else:
                failed = [names[n] for n, v in votes.items() if not v["ok"]]
                self.state.event(f"round {current.round} attempt {current.attempt} aborted "
                                 f"(failed: {', '.join(failed) or 'a member vanished'}); retrying")
        log.info("round %d attempt %d: %s", current.round, current.attempt, decision)
        self.votes.pop((current.round, current.attempt), None)
        self.opened_at.pop((current.round, current.attempt), None)
        self.present.pop((current.round, current.attempt), None)
        if decision == "apply":
            self.barred = defaultdict(set, {n: s for n, s in self.barred.items() if n > current.round})
        self.changed.notify_all()

    def commit(self, node: Node, body: dict) -> dict:
        number, state_hash = int(body["round"]), str(body["state_hash"])[:64]
        applied = [s for s in self.state.rounds(number) if s.decision == "apply"]
        if not applied:
            raise Refused(409, f"round {number} was not applied; nothing to commit")
        with self.lock, self.state.transaction():
            self.state.put_commit(number, node.node_id, state_hash)
            node = self.state.node(node.node_id)
            node.state_hash, node.needs_resync = state_hash, 0
            self.state.put_node(node)
            hashes = self.state.commits(number)
            members = {m["node_id"]: m for m in applied[-1].members}
            # One vote per token: nodes admitted through one token back a hash once, so a leaked
            # token's extra nodes cannot outvote the honest ones and send them to resync.
            backers: dict[str, set[str]] = defaultdict(set)
            for nid, h in hashes.items():
                backer = self.state.node(nid)
                backers[h].add(backer.token_id or nid)
            counts = {h: len(b) for h, b in backers.items()}
            majority = max(counts, key=lambda h: (counts[h], -min(
                self.state.node(n).node_index for n, x in hashes.items() if x == h)))
            if state_hash == majority and node.round < number:
                node.round = number  # a node that caught up by replaying now holds this round
                self.expected.setdefault(node.node_id, number + 1)  # ... and is back for the next
                self.state.put_node(node)
            decided = applied[-1]
            decided.state_hash = majority
            self.state.put_round(decided)
            diverged = [n for n, h in hashes.items() if h != majority and n in members]
            for nid in diverged:
                bad = self.state.node(nid)
                if not bad.needs_resync:
                    bad.needs_resync = 1
                    self.state.put_node(bad)
                    self.state.event(f"round {number}: {bad.name} diverged (hash {hashes[nid]} != {majority}); "
                                     "it will resync from a peer")
                    log.warning("%s diverged at round %d; it will resync", bad.name, number)
        return {"status": "diverged" if node.node_id in diverged else "ok", "majority_hash": majority}

    def tick(self) -> None:
        """Runs every fraction of a second: expires leases and fixes members whose deadline passed."""
        with self.lock:
            self.members.expire()
            for number in list(self.ready):
                self._try_fix_members(number)
            for (number, attempt), votes in list(self.votes.items()):
                decided = self.state.rounds(number)
                current = next((s for s in decided if s.attempt == attempt), None)
                if current and current.decision == "open":
                    gone = [m["node_id"] for m in current.members
                            if not self.members.is_live(m["node_id"]) and m["node_id"] not in votes]
                    if gone:
                        self._decide(current, "abort", votes)
            self._strike_laggards()
            for current in self.state.open_rounds():
                # A member that died before voting (even before anyone voted: in the rendezvous or the
                # state transfer) dooms the attempt; deciding now frees the others from waiting on it.
                votes = self.votes.get((current.round, current.attempt), {})
                if any(not self.members.is_live(m["node_id"]) and m["node_id"] not in votes for m in current.members):
                    self._decide(current, "abort", votes)

    def _strike_laggards(self) -> None:
        """Aborts an attempt held up by a live member that did not show up for it or did not
        vote once every other member had voted ok (see strikes.py), striking that member."""
        now = time.monotonic()
        for current in self.state.open_rounds():
            opened = self.opened_at.get((current.round, current.attempt))
            if opened is None:
                continue
            votes = self.votes.get((current.round, current.attempt), {})
            members = [m["node_id"] for m in current.members]
            late: dict[str, tuple[str, str]] = {}
            came = self.present.get((current.round, current.attempt), set())
            if came and now - opened >= self.config.show_up_grace_s:
                for nid in members:
                    if nid not in came and nid not in votes and self.members.is_live(nid):
                        late[nid] = ("no-show", f"did not begin round {current.round} attempt {current.attempt} "
                                                f"in {now - opened:.0f} s while {len(came)} member(s) did")
            waiting = [nid for nid in members if nid not in votes and self.members.is_live(nid)]
            if votes and waiting and all(v["ok"] for v in votes.values()):
                since = now - max(v["at"] for v in votes.values())
                # A member behind a slow link may still be taking the last of the transfer the others
                # finished: it gets as long again as their transfer took, if that is longer than the grace.
                took = max((v["allreduce_s"] for v in votes.values() if isinstance(v["allreduce_s"], (int, float))),
                           default=0.0)
                if since >= max(self.config.vote_grace_s, took):
                    for nid in waiting:
                        late.setdefault(nid, ("silent", f"no vote {since:.0f} s after the {len(votes)} other "
                                                        f"member(s) voted ok on round {current.round}"))
            if late:
                self._strike_out(current, late, votes)

    def _strike_out(self, current: RoundDecision, struck: dict[str, tuple[str, str]], votes: dict[str, dict]) -> None:
        """Strikes each member of `struck` ({node_id: (kind, why)}), bars it from this round's retries and
        aborts the attempt."""
        with self.state.transaction():
            for nid, (kind, why) in struck.items():
                self.strikes.strike(nid, kind, why)
        self.barred[current.round].update(struck)
        self._decide(current, "abort", votes)

    def epoch_is_dead(self, epoch: int) -> bool:
        """True once the newest attempt of the epoch aborted: its rendezvous will never complete."""
        return self.state.epoch_decision(epoch) == "abort"

    def sources(self, node: Node) -> dict:
        """Where a node that is behind can fetch the state: the live nodes holding the last committed
        round (their transfer servers, one per local rank), and the committed hashes to check it against."""
        with self.lock:
            self.members.expire()
            committed = self.state.committed_round()
            holders = [n for n in self.members.live() if n.round == committed and not n.needs_resync
                       and n.node_id != node.node_id and json.loads(n.servers)]
            others = [n for n in self.members.live() if n.node_id != node.node_id]
            behind = [n.name for n in others if n.round < committed]
            return {"committed_round": committed, "hashes": self.state.committed_hashes(limit=64),
                    "sources": [{"name": n.name, "servers": json.loads(n.servers)} for n in holders],
                    "behind": behind, "alone": not others}

    def wait_commit(self, node: Node, body: dict) -> dict | None:
        """Answers once a round after `after` commits, or at once if none can: no other member is live
        (they finished and left, or died), so nobody else will ever commit one. None: wait on."""
        committed = self.state.committed_round()
        if committed > int(body["after"]):
            return {"committed_round": committed}
        self.members.expire()
        if not any(n.node_id != node.node_id for n in self.members.live()):
            return {"committed_round": committed, "alone": True}
        return None

