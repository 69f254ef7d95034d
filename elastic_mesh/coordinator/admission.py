"""Admission to a run: the join token, the checks that a node fits the run (fingerprint, processes per
node, shared settings, work, initial state), and a node resumed from its saved state, which may roll
the whole run back to it. The Coordinator (core.py) holds one; it must never fix a round's members or
decide a vote."""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time

from elastic_mesh.control.token import TokenError, verify_token
from elastic_mesh.coordinator.config import Refused, check_shared_settings
from elastic_mesh.coordinator.leases import WorkLedgers
from elastic_mesh.coordinator.membership import Membership, hash_session
from elastic_mesh.coordinator.state import CoordinatorState, Node

log = logging.getLogger(__name__)


class Admission:
    """Admitting nodes: everything it touches is handed to it here."""

    def __init__(self, state: CoordinatorState, secret: bytes, run_id: str, config, members: Membership,
                 work: WorkLedgers, lock: threading.RLock) -> None:
        self.state, self.secret, self.run_id, self.config = state, secret, run_id, config
        self.members, self.work, self.lock = members, work, lock

    def join(self, body: dict, peer: str = "") -> dict:
        """Admits a node with a valid token; `peer` is the address its request came from."""
        try:
            token = verify_token(self.secret, self.run_id, str(body.get("token", "")))
        except TokenError as e:
            raise Refused(403, str(e)) from None
        if self.state.token_revoked(token.token_id):
            raise Refused(403, f"token {token.token_id} was revoked; ask the run's operator for a new one")
        strikes = self.state.strikes_of(token.token_id)
        if strikes >= self.config.max_strikes:
            raise Refused(403, f"token {token.token_id} is banned: its nodes held rounds up {strikes} times (see the "
                               "run's events); ask the run's operator for a new one")
        if token.role != "node":
            raise Refused(403, f"this is a{'n' if token.role[0] in 'aeiou' else ''} {token.role} token: it cannot "
                               "join as a training node; ask the run's operator for a node token")
        name = str(body.get("name", ""))[:64] or "node"
        fingerprint, procs = str(body.get("fingerprint", "")), int(body.get("procs_per_node", 0))
        state_hash, address = str(body.get("state_hash", "")), str(body.get("address", ""))[:256] or peer
        host = address.rsplit(":", 1)[0] if address.count(":") == 1 else address
        servers = [f"{host}:{int(p)}" for p in list(body.get("server_ports") or [])[:64]]
        work = _parse_work(body.get("work"))
        restored = int(body.get("restored_round", 0))
        if restored:
            with self.lock:
                self.members.wait_for_reconnects()
        with self.lock, self.state.transaction():
            run_fp = self.state.get_meta("fingerprint")
            run_procs = self.state.get_meta("procs_per_node")
            if run_fp is not None and run_fp != fingerprint:
                raise Refused(409, f"fingerprint {fingerprint} differs from the run's {run_fp}; start the node "
                                   "with the run's config (for prime: same model, seq_len, tokenizer, seed)")
            if run_procs is not None and int(run_procs) != procs:
                raise Refused(409, f"this node runs {procs} processes but the run's nodes run {run_procs} "
                                   f"(global groups pair shards by local rank); use --nproc-per-node {run_procs}")
            run_protocol = json.loads(self.state.get_meta("protocol") or "null")
            protocol = check_shared_settings(run_protocol, body.get("protocol") or {})
            if run_protocol is None:
                self.state.set_meta("protocol", json.dumps(protocol, sort_keys=True))
            for kind, (items, work_id) in work.items():
                run_work = self.state.get_meta(f"work_fingerprint/{kind}")
                ledger = self.work[kind]
                if run_work is not None and (run_work != work_id or ledger.items != items):
                    raise Refused(409, f"this node's {kind} work ({items} items, fingerprint {work_id}) differs from "
                                       f"the run's ({ledger.items} items, fingerprint {run_work}); give it the same "
                                       "input in the same order, cut the same way (for prime: the same files and "
                                       "data.parts_per_file)")
                if run_work is None:
                    self.state.set_meta(f"work_fingerprint/{kind}", work_id)
                    ledger.configure(items)
            committed = self.state.committed_round()
            if restored:
                committed = self._admit_restored(restored, state_hash, committed)
            initial = self.state.get_meta("initial_hash")
            if committed == 0 and initial is not None and initial != state_hash:
                raise Refused(409, f"initial state differs: hash {state_hash} but the run started from {initial}; "
                                   "start from the run's seed and config")
            if run_fp is None:
                self.state.set_meta("fingerprint", fingerprint)
                self.state.set_meta("procs_per_node", procs)
                self.state.set_meta("initial_hash", state_hash)
            index = int(self.state.get_meta("next_node_index", "0"))
            self.state.set_meta("next_node_index", index + 1)
            session = secrets.token_hex(24)
            self._check_cap(token, name)
            taken = {n.name for n in self.state.nodes() if n.state == "active"}
            # A newcomer holds no committed state (round 0 only while nothing has committed yet), a
            # resumed node the round of its saved state.
            node = Node(secrets.token_hex(6), f"{name}-{index}" if name in taken else name,
                        hash_session(session), index, "active", time.time(), restored, state_hash, address,
                        servers=json.dumps(servers), token_id=token.token_id)
            self.state.put_node(node)
            self.state.event(f"{node.name} joined at round {committed}" +
                             (f" (resumed from its saved state of round {restored})" if restored else ""))
            self.members.admit(node.node_id)
            self.members.changed.notify_all()
        log.info("%s joined (node index %d) at round %d", node.name, index, committed)
        return {"node_id": node.node_id, "session": session, "name": node.name, "node_index": index,
                "run_id": self.run_id, "committed_round": committed, "lease_s": self.config.lease_s,
                "heartbeat_s": self.config.heartbeat_s, "poll_s": self.config.poll_s,
                "transfer_key": self.state.get_meta("transfer_key")}

    def _check_cap(self, token, name: str) -> None:
        """A token admits at most max_nodes live nodes at once. The same token and name again is the same
        contributor restarted (its old session may not have expired yet): it replaces that session."""
        live = [n for n in self.members.live() if n.token_id == token.token_id]
        others = [n for n in live if n.name != name]
        if len(others) >= token.max_nodes:  # refused before anything changes (the lease map is not rolled back)
            raise Refused(409, f"token {token.token_id} admits at most {token.max_nodes} live node(s) and "
                               f"{', '.join(n.name for n in others)} hold{'s' if len(others) == 1 else ''} it; give "
                               "each contributor its own token (token create), or one with --max-nodes")
        for old in live:
            if old.name == name:
                self.members.replaced(old.node_id)

    def _admit_restored(self, restored: int, state_hash: str, committed: int) -> int:
        """A node resumed from its saved state of round `restored`: checks it against the hash the run
        committed, and rolls the run back to it when no live node holds anything newer (the whole run was
        stopped and is being resumed). Returns the run's committed round afterwards."""
        expected = self.state.committed_hashes(limit=1 << 30).get(restored)
        if restored > committed or expected is None:
            raise Refused(409, f"this node's saved state is of round {restored}, which this run never committed "
                               f"(committed: {committed}); resume it from a checkpoint of this run")
        if expected != state_hash:
            raise Refused(409, f"this node's saved state of round {restored} hashes to {state_hash}, the run "
                               f"committed {expected}; it is not this run's state")
        newest_held = max((n.round for n in self.members.live() if n.node_id in self.members.heard_from), default=0)
        if committed > restored and newest_held <= restored:
            self._roll_back(committed, restored)
            return restored
        return committed

    def _roll_back(self, committed: int, to: int) -> None:
        self.state.roll_back(to)
        self.work.roll_back(to)
        self.state.event(f"run rolled back from round {committed} to {to}: no live node holds a newer state, "
                         "so it resumes from the nodes' saved state (work cursors included)")
        log.warning("run rolled back from round %d to %d (resumed from saved state)", committed, to)


def _parse_work(work: object) -> dict[str, tuple[int, str]]:
    """{kind: (items, fingerprint)} from a join's `work` field: the kinds of work the node takes."""
    if not work:
        return {}
    if not isinstance(work, dict) or len(work) > 16:
        raise Refused(400, "work must map at most 16 kinds of work to {items, fingerprint}")
    try:
        return {str(kind)[:32]: (int(spec["items"]), str(spec.get("fingerprint", ""))[:64])
                for kind, spec in work.items() if int(spec["items"]) > 0}
    except (KeyError, TypeError, ValueError) as e:
        raise Refused(400, f"malformed work in the join: {e}") from None
