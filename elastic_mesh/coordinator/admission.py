"""Admission to a run: the join token, the checks that a node fits the run (model, processes per node,
shared settings, data, initial weights), and a node resumed from its checkpoint, which may roll the
whole run back to it. A part of the Coordinator (core.py), kept apart because it is a job of its own;
it must never fix a step's members or decide a vote."""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time

from elastic_mesh.coordinator.config import Refused, check_shared_settings
from elastic_mesh.coordinator.state import Node
from elastic_mesh.control.token import TokenError, verify_token

log = logging.getLogger(__name__)


def hash_session(session: str) -> str:
    return hashlib.sha256(session.encode()).hexdigest()


class Admission:
    """Admitting nodes. Mixed into Coordinator, whose state, secret, run_id, config, lock, leases, ledger,
    heard_from and live_nodes it uses."""

    def join(self, body: dict, peer: str = "") -> dict:
        """Admits a node with a valid token; `peer` is the address its request came from."""
        try:
            verify_token(self.secret, self.run_id, str(body.get("token", "")))
        except TokenError as e:
            raise Refused(403, str(e)) from None
        name = str(body.get("name", ""))[:64] or "node"
        fingerprint, procs = str(body.get("fingerprint", "")), int(body.get("procs_per_node", 0))
        model_hash, address = str(body.get("model_hash", "")), str(body.get("address", ""))[:256] or peer
        host = address.rsplit(":", 1)[0] if address.count(":") == 1 else address
        snapshot = [f"{host}:{int(p)}" for p in list(body.get("snapshot_ports") or [])[:64]]
        data_shards, data_id = int(body.get("data_shards", 0)), str(body.get("data_fingerprint", ""))[:64]
        restored = int(body.get("restored_step", 0))
        if restored:
            self._wait_for_reconnects()
        with self.lock, self.state.transaction():
            run_fp = self.state.get_meta("fingerprint")
            run_procs = self.state.get_meta("procs_per_node")
            if run_fp is not None and run_fp != fingerprint:
                raise Refused(409, f"model/config fingerprint {fingerprint} differs from the run's {run_fp}; "
                                   "start the node with the run's config (same model, seq_len, tokenizer, seed)")
            if run_procs is not None and int(run_procs) != procs:
                raise Refused(409, f"this node runs {procs} processes but the run's nodes run {run_procs} "
                                   f"(global groups pair shards by local rank); use --nproc-per-node {run_procs}")
            run_protocol = json.loads(self.state.get_meta("protocol") or "null")
            protocol = check_shared_settings(run_protocol, body.get("protocol") or {})
            if run_protocol is None:
                self.state.set_meta("protocol", json.dumps(protocol, sort_keys=True))
            run_data = self.state.get_meta("data_fingerprint")
            if data_shards and run_data is not None and (run_data != data_id or self.ledger.shards != data_shards):
                raise Refused(409, f"this node's data ({data_shards} shards, fingerprint {data_id}) differs from the "
                                   f"run's ({self.ledger.shards} shards, fingerprint {run_data}); give it the same "
                                   "files in the same order and the same data.parts_per_file")
            if data_shards and run_data is None:
                self.state.set_meta("data_fingerprint", data_id)
                self.ledger.configure(data_shards)
            committed = self.state.committed_step()
            if restored:
                committed = self._admit_restored(restored, model_hash, committed)
            initial = self.state.get_meta("initial_hash")
            if committed == 0 and initial is not None and initial != model_hash:
                raise Refused(409, f"initial weights differ: hash {model_hash} but the run started from {initial}; "
                                   "use the run's train.seed and model config")
            if run_fp is None:
                self.state.set_meta("fingerprint", fingerprint)
                self.state.set_meta("procs_per_node", procs)
                self.state.set_meta("initial_hash", model_hash)
            index = int(self.state.get_meta("next_node_index", "0"))
            self.state.set_meta("next_node_index", index + 1)
            session = secrets.token_hex(24)
            taken = {n.name for n in self.state.nodes() if n.state == "active"}
            # A newcomer holds no committed state (outer step 0 only while nothing has committed yet), a
            # resumed node the step of its checkpoint.
            node = Node(secrets.token_hex(6), f"{name}-{index}" if name in taken else name,
                        hash_session(session), index, "active", time.time(), restored, model_hash, address,
                        snapshot=json.dumps(snapshot))
            self.state.put_node(node)
            self.state.event(f"{node.name} joined at outer step {committed}" +
                             (f" (resumed from its checkpoint of outer step {restored})" if restored else ""))
            self.leases[node.node_id] = time.monotonic() + self.config.lease_s
            self.heard_from.add(node.node_id)
            self.changed.notify_all()
        log.info("%s joined (node index %d) at outer step %d", node.name, index, committed)
        return {"node_id": node.node_id, "session": session, "name": node.name, "node_index": index,
                "run_id": self.run_id, "committed_step": committed, "lease_s": self.config.lease_s,
                "heartbeat_s": self.config.heartbeat_s, "poll_s": self.config.poll_s,
                "snapshot_key": self.state.get_meta("snapshot_key")}

    def _admit_restored(self, restored: int, model_hash: str, committed: int) -> int:
        """A node resumed from its checkpoint of outer step `restored`: checks it against the hash the run
        committed, and rolls the run back to it when no live node holds anything newer (the whole run was
        stopped and is being resumed). Returns the run's committed step afterwards."""
        expected = self.state.committed_hashes(limit=1 << 30).get(restored)
        if restored > committed or expected is None:
            raise Refused(409, f"this node's checkpoint is of outer step {restored}, which this run never committed "
                               f"(committed: {committed}); resume it from a checkpoint of this run")
        if expected != model_hash:
            raise Refused(409, f"this node's checkpoint of outer step {restored} hashes to {model_hash}, the run "
                               f"committed {expected}; it is not this run's state")
        newest_held = max((n.outer_step for n in self.live_nodes() if n.node_id in self.heard_from), default=0)
        if committed > restored and newest_held <= restored:
            self._roll_back(committed, restored)
            return restored
        return committed

    def _wait_for_reconnects(self) -> None:
        """Nodes known from before a coordinator restart get a grace period to reconnect: a resumed node's
        join waits it out (outside any transaction) before concluding that nobody holds newer steps."""
        give_up = time.monotonic() + 2 * self.config.lease_s + 1
        with self.lock:
            while any(n.node_id not in self.heard_from for n in self.live_nodes()) and time.monotonic() < give_up:
                self.changed.wait(timeout=0.25)
                self._expire_leases()

    def _roll_back(self, committed: int, to: int) -> None:
        self.state.roll_back(to)
        self.ledger.roll_back(to)
        self.state.event(f"run rolled back from outer step {committed} to {to}: no live node holds a newer state, "
                         "so it resumes from the nodes' checkpoints (data cursors included)")
        log.warning("run rolled back from outer step %d to %d (resumed from checkpoints)", committed, to)
