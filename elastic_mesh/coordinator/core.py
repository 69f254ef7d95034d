"""The coordinator: one object that the HTTP handlers call, composed of parts that each do one job.

- Membership (membership.py): sessions, heartbeats, liveness leases;
- Admission (admission.py): tokens and the checks that a node fits the run;
- RoundBarrier (barrier.py): who takes part in each round, votes, commits;
- WorkLedgers (leases.py): exactly-once leases of work items of any kind;
- Broadcasts (broadcasts.py): signed versions of broadcast payloads and who holds their chunks.

All of them are called from HTTP handler threads under one lock; long-polls wait on its condition.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time

from elastic_mesh.control.signing import RunSigner
from elastic_mesh.control.tls import RunAuthority
from elastic_mesh.control.token import JoinToken, TokenError, verify_token
from elastic_mesh.coordinator.admission import Admission
from elastic_mesh.coordinator.broadcasts import Broadcasts
from elastic_mesh.coordinator.config import CoordinatorConfig, Refused
from elastic_mesh.coordinator.leases import LedgerError, WorkLedgers
from elastic_mesh.coordinator.membership import Membership, hash_session
from elastic_mesh.coordinator.state import CoordinatorState, Node
from elastic_mesh.coordinator.telemetry import TelemetryLog
from elastic_mesh.coordinator.barrier import RoundBarrier
from elastic_mesh.transfer.evidence import EvidenceError, issue_credential

log = logging.getLogger(__name__)


class Coordinator:
    def __init__(self, state: CoordinatorState, secret: bytes, run_id: str, config: CoordinatorConfig,
                 address: str, signer: RunSigner, authority: RunAuthority | None = None) -> None:
        """authority: the run's TLS authority when it serves TLS; it certifies members' chunk servers."""
        self.state, self.secret, self.run_id, self.config, self.address = state, secret, run_id, config, address
        self.signer, self.authority = signer, authority
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.started = time.monotonic()
        self.telemetry = TelemetryLog(state)
        self.work = WorkLedgers(state.db)
        with self.state.transaction():
            self.state.set_meta("run_id", run_id)
            for key in ("transfer_key", "broadcast_key"):
                if self.state.get_meta(key) is None:
                    # Admitted nodes (broadcast members) present it to each other's chunk servers; tokens
                    # never leave the coordinator. Two keys: a worker fetching broadcasts cannot read
                    # the training nodes' snapshots.
                    self.state.set_meta(key, secrets.token_hex(24))
            if self.state.nodes():
                self.state.event("coordinator restarted; nodes keep their sessions")
        self.members = Membership(state, config, self.work, self.changed)
        self.admission = Admission(state, secret, run_id, config, self.members, self.work, self.lock)
        self.rounds = RoundBarrier(state, config, self.members, self.lock, self.changed)
        self.broadcasts = Broadcasts(state, signer, run_id, self.lock, self.changed, config.broadcast_keep,
                                     config.holder_ttl_s)

    def authorize(self, authorization: str, action: str) -> JoinToken:
        """The token of a request that carries one (Authorization: Bearer TOKEN), checked now: signature,
        run, expiry, revocation. Broadcast members use it instead of a session: they are not nodes."""
        if not authorization.startswith("Bearer "):
            raise Refused(401, f"{action} needs a join token (Authorization: Bearer TOKEN)")
        try:
            token = verify_token(self.secret, self.run_id, authorization[7:])
        except TokenError as e:
            raise Refused(403, str(e)) from None
        if self.state.token_revoked(token.token_id):
            raise Refused(403, f"token {token.token_id} was revoked; ask the run's operator for a new one")
        if token.role == "observer":
            raise Refused(403, f"an observer token reads the status only; {action} needs a node or worker token")
        return token

    def broadcast_hello(self, token: JoinToken, body: dict) -> dict:
        answer = {"status": "ok", "run_id": self.run_id, "public_key": self.signer.public_hex,
                  "broadcast_key": self.state.get_meta("broadcast_key"), "holder_ttl_s": self.config.holder_ttl_s,
                  "publish": token.publish}
        if self.authority is not None and body.get("tls_public_key"):  # it serves chunks to others
            answer["tls_cert"] = self._certify([body["tls_public_key"]], f"{token.role} {token.token_id}",
                                               token.expires_at, token.service)[0]
        if body.get("chunk_key"):  # it signs the chunks it serves (transfer/evidence.py)
            try:
                answer["chunk_credential"] = issue_credential(self.signer, self.run_id, token.token_id,
                                                              str(body["chunk_key"])[:200], token.expires_at)
            except EvidenceError as e:
                raise Refused(400, str(e)) from None
        return answer

    def _certify(self, keys: object, subject: str, expires_at: float | None, service: str = "") -> list[str]:
        """Certificates for members' own keys, so their chunk servers speak TLS that peers trust. A
        broadcast member's ends with its token (every request it makes needs the token anyway)."""
        if not isinstance(keys, list) or not 1 <= len(keys) <= 64 or not all(isinstance(k, str) and len(k) < 4096
                                                                           for k in keys):
            raise Refused(400, "tls_public_keys must list one PEM public key per process (at most 64)")
        try:
            return [self.authority.issue(key, f"{subject}/{i}", expires_at, service) for i, key in enumerate(keys)]
        except ValueError as e:
            raise Refused(400, f"cannot certify this member's key: {e}") from None
    def may_read_status(self, authorization: str, node_id: str, session: str) -> bool:
        if self.config.public_status:
            return True
        if authorization.startswith("Bearer "):
            try:  # any role may read the status (an observer token is made for it), unless revoked
                token = verify_token(self.secret, self.run_id, authorization[7:])
            except TokenError:
                return False
            return not self.state.token_revoked(token.token_id)
        node = self.state.node(node_id) if node_id else None
        return node is not None and hmac.compare_digest(node.session_hash, hash_session(session or ""))

    def join(self, body: dict, peer: str = "") -> dict:
        if self.authority is None:
            return self.admission.join(body, peer)
        try:  # a forged or foreign token hears that first, as it would without TLS
            verify_token(self.secret, self.run_id, str(body.get("token", "")))
        except TokenError as e:
            raise Refused(403, str(e)) from None
        # The run speaks TLS: every server of the node must too, with a certificate peers will trust.
        if not body.get("tls_public_keys"):
            raise Refused(400, "this coordinator serves TLS, so a node must send its servers' public keys "
                               "(tls_public_keys) with its join; update prime on this node")
        # A node's session outlives its token (a run is longer than a join window): its certificates too.
        certificates = self._certify(body["tls_public_keys"], str(body.get("name", "node"))[:48], None)
        return {**self.admission.join(body, peer), "tls_certs": certificates}

    def authenticate(self, node_id: str, session: str) -> Node:
        return self.members.authenticate(node_id, session)

    def heartbeat(self, node: Node, body: dict) -> dict:
        with self.lock:
            self.members.renew(node)
            self.telemetry.received(node.node_id, body.get("telemetry"), time.time())
        return {"committed_round": self.state.committed_round()}

    def leave(self, node: Node) -> dict:
        with self.lock:
            self.members.leave(node)
        return {"ok": True}

    def tick(self) -> None:
        """Runs every fraction of a second: expires leases and fixes members whose deadline passed."""
        self.rounds.tick()

    def lease(self, node: Node, body: dict) -> dict:
        """A free item of one kind of work for one worker (local rank) of `node`, with the cursor to
        consume it from."""
        kind, worker = str(body.get("kind", ""))[:32], int(body["worker"])
        held = [int(s) for s in list(body.get("held") or [])[:4096]]
        procs = int(self.state.get_meta("procs_per_node", "1"))
        if not 0 <= worker < procs:
            raise Refused(400, f"worker {worker} is not a local rank of a {procs}-process node")
        with self.lock, self.state.transaction():
            if kind not in self.work.kinds():
                raise Refused(409, f"this run hands out no {kind!r} work: its nodes joined without it "
                                   f"(kinds: {self.work.kinds()})")
            ledger = self.work[kind]
            # A spare item (the worker consumes several at once) only up to a fair share: the items over
            # every live worker plus one more node's, so a node that joins still finds some free.
            share = ledger.items // ((len(self.members.live()) + 1) * procs) if body.get("spare") else None
            try:
                lease = ledger.lease(node.node_id, worker, held, f"{node.name}/{worker}", share)
            except LedgerError as e:
                raise Refused(409, str(e)) from None
        if lease["item"] is not None:
            log.debug("%s worker %d leased %s item %d (pass %d)", node.name, worker, kind, lease["item"], lease["pass"])
        return lease

    # ---- status ------------------------------------------------------------------------------------
    def history(self, after_id: int) -> dict:
        """Telemetry records after `after_id` and every round's attempts: what the dashboard plots."""
        with self.lock:
            names = {n.node_id: n.name for n in self.state.nodes()}
            return {**self.telemetry.history(after_id, names), "rounds": self.state.round_summaries(limit=100_000),
                    "events": self.state.events(limit=500)}

    def status(self) -> dict:
        with self.lock:
            now = time.time()
            return {
                "run_id": self.run_id, "address": self.address,
                "epoch": self.state.max_epoch(),
                "committed_round": self.state.committed_round(),
                "deadline_s": round(self.rounds.deadline_s(), 2),
                "work": self.work.summary(),
                "nodes": [{"name": n.name, "node_index": n.node_index, "state": n.state,
                           "alive": self.members.is_live(n.node_id), "address": n.address, "joined_at": n.joined_at,
                           "round": n.round, "contributions": n.contributions, "refused": n.refused,
                           "state_hash": n.state_hash,
                           **self.telemetry.node_summary(n.node_id, now)} for n in self.state.nodes()],
                "rounds": self.state.round_summaries(),
                "broadcast": self.broadcasts.summary(),
                "events": self.state.events(),
                "strikes": self.state.strikes(),
            }
