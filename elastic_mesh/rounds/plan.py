"""The member's side of a numbered round: declare ready, vote, commit, and the calls of a member that
is behind (where the committed state can be fetched, promising to be back, waiting for a commit).

Local rank 0 of a node asks the coordinator; every local rank gets the same answer (`Leader`), so the
node's ranks always agree on the plan and the decision. The round's numbers are the caller's (a DiLoCo
outer step, an RL policy version); nothing here knows what a round does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from elastic_mesh.control.client import CoordinatorClient


@dataclass
class RoundPlan:
    status: str  # go | missed | resync
    round: int = 0
    attempt: int = 0
    epoch: int = 0
    rank: int = 0
    world_size: int = 0
    members: list[dict] = field(default_factory=list)
    committed_round: int = 0

    @property
    def contributes(self) -> list[bool]:
        return [bool(m["contributes"]) for m in self.members]


class Leader(Protocol):
    """Runs a coordinator call on local rank 0 and shares its answer (or its error) with every rank."""

    def __call__(self, call: Callable[[], dict]) -> dict: ...


class RoundClient:
    def __init__(self, client: CoordinatorClient, leader: Leader, barrier_timeout_s: float) -> None:
        self.client, self.leader, self.barrier_timeout_s = client, leader, barrier_timeout_s

    def _long_poll(self, path: str, body: dict, done: Callable[[dict], bool]) -> dict:
        return self.leader(lambda: self.client.long_poll(path, body, done, self.barrier_timeout_s))

    def plan(self, number: int, contributes: bool = True) -> RoundPlan:
        """Declares this node ready for round `number`; returns who takes part once the coordinator decides."""
        answer = self._long_poll("/v1/ready", {"round": number, "contributes": contributes},
                                 lambda a: a.get("status") != "wait")
        return RoundPlan(**{k: answer[k] for k in RoundPlan.__dataclass_fields__ if k in answer})

    def present(self, plan: RoundPlan) -> None:
        """Tells the coordinator this node has begun its attempt: a member that does not, while others do,
        is struck and the attempt retried without it (coordinator/strikes.py)."""
        self.leader(lambda: self.client.post("/v1/present", {"round": plan.round, "attempt": plan.attempt}))

    def vote(self, plan: RoundPlan, ok: bool, refused: dict[int, str], blame: list[int], seconds: float,
             consumed: dict[str, list[dict]] | None = None) -> str:
        """Asks the coordinator whether every member succeeded; 'apply' or 'abort', the same for all.
        `consumed` is the work the node's workers did this round, by kind (see coordinator/leases.py):
        recorded only if the round is applied with this node's contribution counted."""
        body = {"round": plan.round, "attempt": plan.attempt, "ok": ok, "allreduce_s": seconds,
                "refused": {plan.members[r]["node_id"]: why for r, why in refused.items()},
                "blame": [plan.members[r]["node_id"] for r in blame], "consumed": consumed or {}}
        return self._long_poll("/v1/vote", body, lambda a: "decision" in a)["decision"]

    def commit(self, number: int, state_hash: str) -> dict:
        return self.leader(lambda: self.client.post("/v1/commit", {"round": number, "state_hash": state_hash}))

    def sources(self) -> dict:
        """The last committed round, its recent hashes, the peers that hold it, the members behind it, and
        whether this node is alone in the run (same for all local ranks)."""
        answer = self.leader(lambda: self.client.post("/v1/sources", {}))
        answer["hashes"] = {int(k): v for k, v in answer["hashes"].items()}
        return answer

    def will_join(self, number: int) -> bool:
        """Tells the coordinator the round this node, still catching up, will be back for, so that round's
        barrier waits for it (up to the deadline). False if that round's members are fixed already."""
        return self.leader(lambda: self.client.post("/v1/will_join", {"round": number}))["status"] == "ok"

    def wait_commit(self, after: int) -> dict:
        """Blocks until a round after `after` commits, or until none can: {committed_round, alone}, where
        alone means no other member is live, so this node is the run's only member now."""
        answer = self._long_poll("/v1/wait_commit", {"after": after}, lambda a: "committed_round" in a)
        return {"committed_round": int(answer["committed_round"]), "alone": bool(answer.get("alone"))}
