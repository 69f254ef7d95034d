"""What one worker token may hold of the run's work: how many leases at once, and when the leases it
takes and never finishes evict it. A token that takes every lease and answers none would otherwise hold
all the prompts in flight (tried at e408968: the honest workers fell from 69 to 2 steps a minute).

A new worker may hold `first_leases` at once; every two leases it finishes (rollouts verified) earn it
one more, up to `max_leases`; every lease it lets expire or gives back costs it one. It keeps one lease
at a time at the least, until its unfinished leases pass `max_unfinished` while they outnumber its
finished ones: then it is evicted. An honest worker that is slow now and then finishes far more than
it drops and is never evicted; one that never answers is, after max_unfinished + 1 leases.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from prime.rl.orchestrator.records import WorkerStats


class LeaseShares(BaseModel):
    """How much of the run's work one worker token may hold (see prime/rl/orchestrator/shares.py)."""

    model_config = ConfigDict(extra="forbid")

    first_leases: int = Field(4, ge=1, description="Leases a worker not yet judged may hold at once.")
    max_leases: int = Field(32, ge=1, description="Leases any one worker may hold at once, however much it finished.")
    max_unfinished: int = Field(8, ge=0, description="Leases a worker may let expire or give back, beyond those it "
                                "finished, before it is evicted.")

    @model_validator(mode="after")
    def _ordered(self) -> "LeaseShares":
        if self.first_leases > self.max_leases:
            raise ValueError(f"first_leases ({self.first_leases}) is over max_leases ({self.max_leases})")
        return self

    def allowed(self, stats: WorkerStats) -> int:
        """Leases this worker may hold at once now (at least 1)."""
        earned = self.first_leases + stats.finished // 2 - self.unfinished(stats)
        return max(1, min(self.max_leases, earned))

    @staticmethod
    def unfinished(stats: WorkerStats) -> int:
        return stats.expired + stats.given_back

    def evicts(self, stats: WorkerStats) -> str | None:
        """Why this worker's unfinished leases evict it, or None."""
        unfinished = self.unfinished(stats)
        if unfinished > self.max_unfinished and unfinished > stats.finished:
            return (f"{unfinished} leases expired or given back ({stats.expired} expired) against {stats.finished} "
                    f"finished: over the limit of {self.max_unfinished}")
        return None
