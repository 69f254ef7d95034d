"""When failed rollouts evict a worker: evidence over time, not one verdict (issue 51).

An honest worker's rollout fails verification now and then (calibration tails, a near-tie the limits
did not foresee: 1 honest chunk in ~3,300 once evicted a float32 worker here), so one failed rollout is
dropped with its lease, not a reason to evict. Each verified rollout moves the worker's score by the
log-likelihood ratio of "cheater" (a rollout fails with probability `cheat_reject_rate`) against
"honest" (`honest_reject_rate` of the worker's dtype: 1 in 1000 for float32, 1 in 100 for bfloat16),
and the score is kept at or above 0 (a CUSUM, Page's test): for float32 a failed rollout adds
log(p1/p0) (6.2), a passed one log((1-p1)/(1-p0)) (-0.69). The worker is evicted once the score
reaches `evict_at` (log 1/alpha: 13.8 for alpha 1e-6).

So a worker whose every rollout fails is evicted at its first submission of 8, one honest false
reject among passes costs nothing lasting, and a worker cheating on a fraction of its rollouts is
evicted when that fraction is above ~10% (below, its failed rollouts are simply dropped: they never
enter a batch). Malformed submissions evict at once: no honest worker sends one.

Drift: a systematic bias too small to fail one rollout (weights one tiny step stale, a slightly
different kernel) still shows in how often a passed rollout's chunk proof differs from the
recomputation at all. Calibration bounds that share for honest workers of each dtype
(`Limits.deviation_rate`: the margin over the share pooled across its conditions, 2% at least); a
second CUSUM tests the worker's own share against it, tuned to a cheater at `drift_ratio` times the
bound, and evicts at the same `evict_at`. Measured on the tiny policy (launch/bench/toploc_workers.py):
honest float32 chunks differ 0.94-1.36% of the time against a bound of 2%; weights one AdamW step at
lr 1e-8 stale, every rollout passing, 8.1%: evicted after 72 rollouts in one run of 192. Where honest
chunks mostly differ anyway (bfloat16 workers: the bound is over `drift_above`), this test is off: it
would need a statistic of the difference's size.

The drift test is off by default (`drift`): it counts chunks as independent, but the samples of a GRPO
group share their prompt and their chunks differ together. In rl_adversarial (digit policy, bound 25%)
an honest worker whose chunks differed 1.8% of the time was evicted after two groups in a row differed.
Counting per prompt group, and calibrating that, is still to do.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

from prime.rl.orchestrator.records import WorkerStats
from prime.verify.thresholds import ComputeDtype
from prime.verify.verifier import Verdict


class RolloutEvidence(BaseModel):
    """When verified rollouts evict a worker (see prime/rl/orchestrator/evidence.py)."""

    model_config = ConfigDict(extra="forbid")

    honest_reject_rate: dict[ComputeDtype, float] = Field(
        default_factory=lambda: {"float32": 1e-3, "bfloat16": 1e-2},
        description="Per worker compute dtype, the rate at which an honest worker's rollouts fail verification, as "
                    "the test assumes (measured, toploc_workers.py: float32 0 of 2000, bfloat16 6 of 2000).")
    cheat_reject_rate: float = Field(0.5, gt=0, lt=1, description="The failure rate of the cheater the test is "
                                     "tuned to catch quickest.")
    evict_at: float = Field(13.8, gt=0, description="The score (log-likelihood ratio, log 1/alpha) at which a "
                            "worker is evicted (below log(cheat/honest rate): on the first failed rollout).")

    drift: bool = Field(False, description="Run the drift test. Off by default: it counts chunks as independent, "
                        "but a GRPO group's samples share their prompt and deviate together; rl_adversarial evicted an "
                        "honest worker whose chunks differed 1.8% of the time against a 25% bound (two groups in a row).")
    drift_ratio: float = Field(4.0, gt=1, description="The drift test is tuned to a worker whose passed rollouts "
                               "deviate this many times as often as the honest bound (Limits.deviation_rate).")
    drift_above: float = Field(0.25, gt=0, le=1, description="An honest bound above this share turns the drift "
                               "test off for that dtype (bfloat16 workers deviate nearly always).")

    @model_validator(mode="after")
    def _ordered(self) -> "RolloutEvidence":
        for dtype, rate in self.honest_reject_rate.items():
            if not 0 < rate < self.cheat_reject_rate:
                raise ValueError(f"honest_reject_rate of {dtype} ({rate}) must be above 0 and below "
                                 f"cheat_reject_rate ({self.cheat_reject_rate})")
        return self

    def weigh(self, stats: WorkerStats, failed: int, passed: int, dtype: str = "float32") -> float:
        """Adds a submission's verdicts to the worker's score (failed rollouts first: a submission that
        mixes them is judged as harshly as it can be); its score now."""
        p0, p1 = self.honest_reject_rate.get(dtype, max(self.honest_reject_rate.values())), self.cheat_reject_rate
        score = stats.evidence + failed * math.log(p1 / p0)
        stats.evidence = max(0.0, score + passed * math.log((1 - p1) / (1 - p0)))
        return max(stats.evidence, score)

    def evicts(self, score: float) -> bool:
        return score >= self.evict_at

    def judge(self, stats: WorkerStats, verdicts: list[Verdict], honest_rate: float | None,
              dtype: str = "float32") -> tuple[float, str]:
        """Weighs a submission's verdicts (`honest_rate`: the dtype's Limits.deviation_rate): (the failure
        score's peak, why its drift evicts the worker or '')."""
        failed = sum(not v.accepted for v in verdicts)
        passed = [c for v in verdicts if v.accepted for c in v.chunks]
        deviating = sum(c.deviates for c in passed)
        score = self.weigh(stats, failed, len(verdicts) - failed, dtype)
        drift = self.weigh_drift(stats, deviating, len(passed) - deviating, honest_rate)
        if not self.evicts(drift):
            return score, ""
        return score, (f"its passed rollouts' proofs differ from the recomputation too often ({stats.deviating} of "
                       f"{stats.compared} chunks; honest bound {honest_rate:.1%}, drift evidence {drift:.1f})")

    def weigh_drift(self, stats: WorkerStats, deviating: int, clean: int, honest_rate: float | None) -> float:
        """Adds passed rollouts' chunks to the worker's drift score (deviating first); its peak. 0 when the
        dtype's thresholds bound no share, or too high a one for the test to tell anything."""
        stats.deviating, stats.compared = stats.deviating + deviating, stats.compared + deviating + clean
        if not self.drift or honest_rate is None or honest_rate > self.drift_above:
            return 0.0
        p0, p1 = honest_rate, min(0.9, self.drift_ratio * honest_rate)
        score = stats.drift + deviating * math.log(p1 / p0)
        stats.drift = max(0.0, score + clean * math.log((1 - p1) / (1 - p0)))
        return max(stats.drift, score)
