"""When failed rollouts evict a worker: evidence over time, not one verdict (issue 51).

An honest worker's rollout fails verification now and then (calibration tails, a near-tie the limits
did not foresee: 1 honest chunk in ~3,300 once evicted a float32 worker here), so one failed rollout is
dropped with its lease, not a reason to evict. Each verified rollout moves the worker's score by the
log-likelihood ratio of "cheater" (a rollout fails with probability `cheat_reject_rate`) against
"honest" (`honest_reject_rate`), and the score is kept at or above 0 (a CUSUM, Page's test): a failed
rollout adds log(p1/p0) (6.2 at the defaults), a passed one log((1-p1)/(1-p0)) (-0.69). The worker is
evicted once the score reaches `evict_at` (log 1/alpha: 13.8 for alpha 1e-6, the chance an honest
worker at p0 ever crosses it over a run's worth of rollouts is of that order).

So a worker whose every rollout fails is evicted within its first 3 failed rollouts (one submission
of 8 does it), one honest false reject among passes costs nothing lasting, and a worker cheating on
a fraction of its rollouts is evicted when that fraction is above ~10% (below, its failed rollouts are
simply dropped: they never enter a batch). Malformed submissions evict at once: no honest worker sends
one.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

from prime.rl.orchestrator.records import WorkerStats


class RolloutEvidence(BaseModel):
    """When verified rollouts evict a worker (see prime/rl/orchestrator/evidence.py)."""

    model_config = ConfigDict(extra="forbid")

    honest_reject_rate: float = Field(1e-3, gt=0, lt=1, description="The rate at which an honest worker's rollouts "
                                      "fail verification, as assumed by the test (measured: 0 of 302 rollouts).")
    cheat_reject_rate: float = Field(0.5, gt=0, lt=1, description="The failure rate of the cheater the test is "
                                     "tuned to catch quickest.")
    evict_at: float = Field(13.8, gt=0, description="The score (log-likelihood ratio, log 1/alpha) at which a "
                            "worker is evicted (below log(cheat/honest rate): on the first failed rollout).")

    @model_validator(mode="after")
    def _ordered(self) -> "RolloutEvidence":
        if self.cheat_reject_rate <= self.honest_reject_rate:
            raise ValueError(f"cheat_reject_rate ({self.cheat_reject_rate}) must be above honest_reject_rate "
                             f"({self.honest_reject_rate})")
        return self

    def weigh(self, stats: WorkerStats, failed: int, passed: int) -> float:
        """Adds a submission's verdicts to the worker's score (failed rollouts first: a submission that
        mixes them is judged as harshly as it can be); its score now."""
        p0, p1 = self.honest_reject_rate, self.cheat_reject_rate
        score = stats.evidence + failed * math.log(p1 / p0)
        stats.evidence = max(0.0, score + passed * math.log((1 - p1) / (1 - p0)))
        return max(stats.evidence, score)

    def evicts(self, score: float) -> bool:
        return score >= self.evict_at
