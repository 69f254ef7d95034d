"""Who is in the run right now: sessions, heartbeats and the liveness leases that expire them.

Leases are timed on this process's monotonic clock only: no wall clocks are compared across machines.
A node whose lease runs out, or whose lifeline connection closes (control/lifeline.py: its process
died), is declared dead and its work goes back to the pool. Callers hold the
coordinator's lock (its condition is `changed`) around every method that writes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time

from elastic_mesh.coordinator.config import CoordinatorConfig, Refused
from elastic_mesh.coordinator.leases import WorkLedgers
from elastic_mesh.coordinator.state import CoordinatorState, Node

log = logging.getLogger(__name__)


def hash_session(session: str) -> str:
    return hashlib.sha256(session.encode()).hexdigest()


class Membership:
    def __init__(self, state: CoordinatorState, config: CoordinatorConfig, work: WorkLedgers,
                 changed: threading.Condition) -> None:
        self.state, self.config, self.work, self.changed = state, config, work, changed
        self.leases: dict[str, float] = {}  # node_id -> monotonic time its lease runs out
        self.heard_from: set[str] = set()  # nodes that made a request to this process (not just in the state)
        now = time.monotonic()
        for node in state.nodes():
            if node.state == "active":
                self.leases[node.node_id] = now + config.lease_s * 2  # grace for nodes to reconnect

    def authenticate(self, node_id: str, session: str) -> Node:
        """The node making a request, or Refused. Every request but join and status goes through here."""
        node = self.state.node(node_id) if node_id else None
        if node is None or not hmac.compare_digest(node.session_hash, hash_session(session or "")):
            raise Refused(401, "unknown node or wrong session; join again with a valid token")
        if node.state != "active":
            raise Refused(410, f"{node.name} was declared {node.state}; join again to continue")
        if node.token_id and self.state.token_revoked(node.token_id):  # `token revoke` takes effect here
            with self.changed, self.state.transaction():  # its lock: requests are authenticated outside it
                self.evict(node.node_id)
                self.state.event(f"{node.name} evicted (its token {node.token_id} was revoked)")
                self.changed.notify_all()
            log.warning("%s evicted: its token %s was revoked", node.name, node.token_id)
            raise Refused(410, f"the token that admitted {node.name} was revoked; ask the run's operator for a new one")
        self.heard_from.add(node.node_id)
        return node

    def admit(self, node_id: str) -> None:
        self.leases[node_id] = time.monotonic() + self.config.lease_s
        self.heard_from.add(node_id)

    def renew(self, node: Node) -> None:
        self.expire()
        if self.state.node(node.node_id).state != "active":
            raise Refused(410, f"{node.name} was declared dead; join again to continue")
        self.leases[node.node_id] = time.monotonic() + self.config.lease_s

    def leave(self, node: Node) -> None:
        with self.state.transaction():
            node.state = "left"
            self.state.put_node(node)
            self.leases.pop(node.node_id, None)
            self.work.release(node.node_id)
            self.state.event(f"{node.name} left")
        self.changed.notify_all()
        log.info("%s left", node.name)

    def evict(self, node_id: str) -> None:
        """Inside the caller's transaction: the node is out of the run (it sent invalid data, or its
        token was revoked); its work goes back to the pool."""
        node = self.state.node(node_id)
        node.state = "evicted"
        self.state.put_node(node)
        self.leases.pop(node_id, None)
        self.work.release(node_id)

    def replaced(self, node_id: str) -> None:
        """Inside the caller's transaction: a new session of the same token and name (the contributor
        restarted) takes the place of this one, whose process is gone or about to be."""
        node = self.state.node(node_id)
        node.state = "dead"
        self.state.put_node(node)
        self.leases.pop(node_id, None)
        self.work.release(node_id)
        self.state.event(f"{node.name}'s session ended: it joined again with the same token")

    def expire(self) -> None:
        now = time.monotonic()
        expired = [n for n, until in self.leases.items() if until < now]
        for node_id in expired:
            self._declare_dead(node_id, f"no heartbeat for {self.config.lease_s:g} s")
        if expired:
            self.changed.notify_all()

    def lifeline_closed(self, node_id: str, session_hash: str) -> None:
        """The node's lifeline connection closed without a leave: its process is gone (the kernel closes
        a dead process's connections at once), so it is dead now rather than when its lease runs out.
        A lifeline of an older session (the node rejoined since) changes nothing."""
        node = self.state.node(node_id)
        if node is not None and node.state == "active" and node.session_hash == session_hash:
            self._declare_dead(node_id, "its connection closed: the process is gone")
            self.changed.notify_all()

    def _declare_dead(self, node_id: str, why: str) -> None:
        self.leases.pop(node_id, None)
        node = self.state.node(node_id)
        if node and node.state == "active":
            with self.state.transaction():
                node.state = "dead"
                self.state.put_node(node)
                self.work.release(node.node_id)  # its uncommitted work goes back to the pool
                self.state.event(f"{node.name} declared dead ({why})")
            log.warning("%s declared dead: %s", node.name, why)

    def is_live(self, node_id: str) -> bool:
        return node_id in self.leases

    def live(self) -> list[Node]:
        return [n for n in self.state.nodes() if n.state == "active" and n.node_id in self.leases]

    def wait_for_reconnects(self) -> None:
        """Nodes known from before a coordinator restart get a grace period to reconnect (the caller holds
        the lock, outside any transaction)."""
        give_up = time.monotonic() + 2 * self.config.lease_s + 1
        while any(n.node_id not in self.heard_from for n in self.live()) and time.monotonic() < give_up:
            self.changed.wait(timeout=0.25)
            self.expire()
