"""The coordinator's settings, the error its decisions answer a request with, and the join checks that need no state."""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field

from elastic_mesh.control.service import ServiceLimits


class CoordinatorConfig(BaseModel):
    """Time-outs and limits of the control plane."""

    model_config = ConfigDict(extra="forbid")

    lease_s: float = Field(6.0, gt=0, description="A node that sends no heartbeat for this long is declared dead.")
    heartbeat_s: float = Field(1.0, gt=0, description="How often nodes are told to send heartbeats.")
    min_wait_s: float = Field(10.0, ge=0, description="Shortest wait for late nodes at a round's barrier.")
    deadline_factor: float = Field(
        0.5, ge=0, description="Wait for late nodes up to this fraction of the median measured round time.")
    poll_s: float = Field(5.0, gt=0, description="Longest a long-poll request is held before 'wait' is answered.")
    start_nodes: int = Field(1, ge=1, description="The first round waits until this many nodes are ready.")
    show_up_grace_s: float = Field(
        10.0, gt=0, description="A member that has not begun its attempt (/v1/present) this long after the attempt "
        "opened, while others have, is a no-show: the attempt is aborted and retried without it, and it is struck.")
    vote_grace_s: float = Field(
        10.0, gt=0, description="A member that has not voted this long after every other member voted ok is "
        "silent: the attempt is aborted and retried without it, and it is struck.")
    max_strikes: int = Field(2, ge=1, description="A token whose nodes were struck this many times (no-show, silent, "
                             "a work report that is not theirs) is banned: its nodes evicted, its joins refused.")
    public_status: bool = Field(False, description="Serve /status to anyone; otherwise it needs a join token "
                                "(Authorization: Bearer TOKEN) or a node's session.")
    max_request_bytes: int = Field(1 << 20, gt=0, description="Larger requests are refused (HTTP 413).")
    broadcast_keep: int = Field(4, ge=1, description="Broadcast versions of each kind the coordinator keeps "
                                "(signed manifests and holders); older ones are forgotten.")
    holder_ttl_s: float = Field(10.0, gt=0, description="A broadcast holder that has not renewed its `have` for "
                                "this long is no longer named as a source.")
    service: ServiceLimits = Field(default_factory=lambda: ServiceLimits(max_connections=768,
                                                                         max_connections_per_peer=128),
                                   description="What one client may take of the coordinator's HTTP: connections "
                                   "per address and in all, time-outs, a token's request rate.")
    lease_only: bool = Field(False, description="Declare a node dead only when its lease runs out. By default "
                             "a node is also declared dead as soon as its lifeline connection closes without a "
                             "leave (the kernel closes a killed process's connections at once); silence (a "
                             "dead machine or link) is always the lease's.")


class Refused(Exception):
    """A request the coordinator will not carry out; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def check_shared_settings(run: dict | None, node: object) -> dict:
    """The settings every node of a run must share (for prime: diloco.inner_steps, mode, ...), as the joining node
    sent them; refused with each difference named when they differ from the run's (`run`: None for the
    first node, whose settings become the run's)."""
    if not isinstance(node, dict) or len(json.dumps(node)) > 4096:
        raise Refused(400, "protocol must be a small JSON object of the settings every node must share")
    if run is not None and run != node:
        differ = sorted(k for k in set(run) | set(node) if run.get(k) != node.get(k))
        raise Refused(409, "settings every node must share differ: " + ", ".join(
            f"{k} is {node.get(k)!r} here but {run.get(k)!r} in the run" for k in differ)
            + "; start the node with the run's settings")
    return node

