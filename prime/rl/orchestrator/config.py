"""The orchestrator's settings: the task, GRPO's grouping and filters, the async level, leases, eval."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from elastic_mesh import ServiceLimits

from prime.rl.environments import EnvConfig
from prime.rl.environments.reverse import ReverseConfig
from prime.rl.environments.terms import RewardTerms
from prime.rl.orchestrator.evidence import RolloutEvidence
from prime.rl.orchestrator.shares import LeaseShares


class OnlineFilter(BaseModel):
    """Which groups carry no signal and are dropped before a batch reaches the trainer."""

    model_config = ConfigDict(extra="forbid")

    drop_flat: bool = Field(True, description="Drop a group whose rewards are all equal (zero advantage).")
    drop_all_solved: bool = Field(True, description="Drop a prompt that every sample solves.")
    drop_none_solved: bool = Field(False, description="Drop a prompt that no sample solves. Off by default: with "
                                   "partial-credit rewards (reverse) early groups solve nothing yet still teach.")
    solved_at: float = Field(1.0, gt=0, le=1, description="A sample with at least this reward solved its prompt.")


class OrchestratorConfig(BaseModel):
    """What the orchestrator hands out and accepts: the task, GRPO's grouping and filters, the async
    level, leases and evaluation. The same for every worker; workers never choose any of it."""

    model_config = ConfigDict(extra="forbid")

    env: EnvConfig = Field(default_factory=ReverseConfig, description="The task source, by name: reverse (built in), "
                           "reasoning-gym (a procedural dataset), math (a local NuminaMath-style jsonl).")
    reward_terms: RewardTerms = Field(default_factory=RewardTerms, description="Optional format and length terms.")
    seed: int = Field(0, description="Seed of the task stream and of the sampling seeds handed to workers.")
    group_size: int = Field(8, ge=2, le=256, description="Completions per prompt (G).")
    prompts_per_step: int = Field(32, ge=1, description="Prompts whose groups make one trainer batch.")
    async_level: int = Field(2, ge=0, le=64, description="k: a batch for step s takes rollouts of policy versions "
                             ">= s - k; older ones are dropped and counted (INTELLECT-2: 2).")
    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature workers must use.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus workers must use.")
    max_tokens: int = Field(5, ge=1, le=4096, description="Completion limit (reverse: max_digits + 1 for EOS).")
    prompts_per_lease: int = Field(4, ge=1, le=256, description="Prompts (each with G seeds) in one worker lease.")
    lease_s: float = Field(20.0, gt=0, description="A lease not returned in this time goes back to the pool; "
                           "its late rollouts are refused.")
    std_epsilon: float = Field(1e-4, gt=0, description="Added to a group's reward std before dividing.")
    filter: OnlineFilter = Field(default_factory=OnlineFilter)
    eval_every: int = Field(10, ge=1, description="Held-out reward (greedy) of every this many-th policy version.")
    stop_at_reward: float | None = Field(None, gt=0, le=1, description="End the run once a held-out eval reaches this.")
    verify_batch_size: int = Field(64, ge=1, description="Rollouts per verification prefill.")
    shares: LeaseShares = Field(default_factory=LeaseShares, description="How many leases one worker may hold "
                                "at once, and when leases it never finishes evict it.")
    evidence: RolloutEvidence = Field(default_factory=RolloutEvidence, description="When failed rollouts evict a "
                                      "worker: one is dropped with its lease, a run of them evicts.")
    poll_s: float = Field(10.0, gt=0, description="Longest a lease or batch request waits before answering 'wait'.")
    service: ServiceLimits = Field(default_factory=ServiceLimits, description="What one client may take of the "
                                   "orchestrator's HTTP: connections per address and in all, time-outs, a token's "
                                   "request rate.")
