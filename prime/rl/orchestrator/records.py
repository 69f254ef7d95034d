"""What the orchestrator keeps about its work: leased prompt instances, leases, verified groups of
rollouts, and each worker token's record (counters the dashboard and a restart read)."""

from __future__ import annotations

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
