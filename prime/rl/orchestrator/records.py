"""What the orchestrator keeps about its work: leased prompt instances, leases, verified groups of
rollouts, and each worker token's record (counters the dashboard and a restart read)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prime.inference.engine import Completion
from prime.rl.environments.base import Task


@dataclass
class Prompt:
    """One leased prompt instance: `number` is unique for the run, so a batch can prove no duplicates."""

    number: int
    task: Task
    tokens: list[int]


@dataclass
class Lease:
    lease_id: str
    worker: str  # token id
    version: int
    prompts: list[Prompt]
    seeds: list[list[int]]  # per prompt, G seeds
    deadline: float
    granted_at: float  # monotonic; with Group's times, where a batch's time went (batch stats)


@dataclass
class Group:
    prompt: Prompt
    version: int
    worker: str
    completions: list[Completion]
    rewards: list[float]
    granted_at: float    # monotonic: its lease was handed out,
    submitted_at: float  # its rollouts arrived,
    verified_at: float   # they passed verification (and were scored)


@dataclass
class WorkerStats:
    """One worker token's record, for the dashboard: what it did and how it was judged."""

    leases: int = 0       # leases granted
    verified: int = 0     # rollouts that passed verification and were scored
    rejected: int = 0     # rollouts refused (failed verification, malformed, or dropped at its eviction)
    stale: int = 0        # rollouts that came back from a version too old to use
    expired: int = 0      # leases it did not return in time
    given_back: int = 0   # leases it handed back unworked
    finished: int = 0     # leases whose rollouts were all verified
    verify_s: float = 0.0  # the orchestrator's time spent verifying its rollouts
    last_seen_s: float = 0.0  # run time of its last lease or submission
    evidence: float = 0.0  # its failed rollouts' weight against it (prime/rl/orchestrator/evidence.py)
    drift: float = 0.0  # its passed rollouts' deviating chunks' weight against it (the same)
    deviating: int = 0  # chunks of its passed rollouts whose proof differed from the recomputation at all
    compared: int = 0  # chunks of its passed rollouts


@dataclass
class Counters:
    rollouts_accepted: int = 0
    rollouts_rejected: int = 0
    rollouts_stale: int = 0
    groups_filtered: int = 0
    leases_expired: int = 0
    workers_evicted: int = 0
    evicted: dict[str, str] = field(default_factory=dict)
    workers: dict[str, WorkerStats] = field(default_factory=dict)

    def of(self, worker: str) -> WorkerStats:
        return self.workers.setdefault(worker, WorkerStats())


def batch_timing(groups: list[Group], asked_at: float) -> dict:
    """Where a batch's time went, in seconds (medians over its groups): lease handed out -> rollouts
    arrived (the worker's generation and the network), arrived -> verified (upload, verification and
    waiting for the version to verify against), verified -> in this batch; and from the trainer's first
    request for it (made while it trains the batch before) to its build: 0 when it was ready first."""
    now = time.monotonic()

    def median(values: list[float]) -> float:
        return round(sorted(values)[len(values) // 2], 4)
    return {"leased_to_arrived_s": median([g.submitted_at - g.granted_at for g in groups]),
            "arrived_to_verified_s": median([g.verified_at - g.submitted_at for g in groups]),
            "verified_to_batch_s": median([now - g.verified_at for g in groups]),
            "asked_to_built_s": round(max(0.0, now - asked_at), 4)}
