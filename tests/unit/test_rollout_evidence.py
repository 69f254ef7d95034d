"""The per-worker evidence over time (prime/rl/orchestrator/evidence.py), on verdict sequences drawn with
a seed: what it takes to evict, and what an honest worker's noise never reaches. The orchestrator's own
use of it, with real verification, is in test_rl_orchestrator.py."""

from __future__ import annotations

import random

from prime.rl.orchestrator.evidence import RolloutEvidence
from prime.rl.orchestrator.records import WorkerStats
from prime.verify.proof import ChunkComparison
from prime.verify.verifier import Check, Verdict

CLEAN = ChunkComparison(0, 0.0, 0, 127, 0)
DEVIATING = ChunkComparison(0, 1 / 127, 1, 127, 1)


def _verdict(passed: bool, chunks: list[ChunkComparison]) -> Verdict:
    return Verdict([Check("activations", passed, "" if passed else "made to fail")], chunks)


def _submissions(rng: random.Random, deviation: float, failure: float = 0.0, chunks: int = 3, per: int = 8):
    while True:
        yield [_verdict(rng.random() >= failure, [DEVIATING if rng.random() < deviation else CLEAN
                                                  for _ in range(chunks)]) for _ in range(per)]


def _rollouts_to_eviction(evidence: RolloutEvidence, submissions, bound: float | None, limit: int) -> int | None:
    stats = WorkerStats()
    for done in range(0, limit, 8):
        verdicts = next(submissions)
        score, drifted = evidence.judge(stats, verdicts, bound)
        if drifted or evidence.evicts(score):
            return done + 8
    return None


def test_honest_noise_never_evicts_and_a_drift_hidden_in_every_rollout_does():
    """With the drift test on (off by default: chunks of one GRPO group differ together, see evidence.py)."""
    evidence, rng = RolloutEvidence(drift=True), random.Random(0)
    # Honest: chunks deviate at the measured 0.94% (tiny policy), a rollout fails at 1 in 1000; bound 2%.
    for seed in range(5):
        honest = _submissions(random.Random(seed), deviation=0.0094, failure=1e-3)
        assert _rollouts_to_eviction(evidence, honest, 0.02, 10_000) is None
    # Weights one AdamW step at lr 1e-8 stale: every rollout passes, 8.1% of chunks deviate.
    stale = [_rollouts_to_eviction(evidence, _submissions(random.Random(s), deviation=0.081), 0.02, 10_000)
             for s in range(5)]
    assert all(n is not None and n <= 400 for n in stale), stale
    # bfloat16 workers are assumed to fail 1 in 100 (measured 6 of 2000): at 0.3% none is evicted either.
    for seed in range(3):
        bf16 = _submissions(random.Random(seed), deviation=1.0, failure=3e-3)
        stats = WorkerStats()
        for _ in range(10_000 // 8):
            score, drifted = evidence.judge(stats, next(bf16), 1.0, "bfloat16")
            assert not evidence.evicts(score) and not drifted
    # Without a bound (thresholds from before it), or with a bound too high to tell (bfloat16), drift is off.
    for bound in (None, 0.5):
        assert _rollouts_to_eviction(evidence, _submissions(rng, deviation=0.3), bound, 2_000) is None


def test_failed_rollouts_evict_by_how_often_they_fail():
    evidence = RolloutEvidence()
    every = _submissions(random.Random(1), deviation=0.0, failure=1.0)
    assert _rollouts_to_eviction(evidence, every, 0.02, 100) == 8  # one submission of 8 failed rollouts
    half = _submissions(random.Random(2), deviation=0.0, failure=0.5)
    assert _rollouts_to_eviction(evidence, half, 0.02, 100) <= 16
    stats = WorkerStats()
    one = [_verdict(i > 0, [CLEAN]) for i in range(8)]  # an honest false reject among 8
    score, drifted = evidence.judge(stats, one, 0.02)
    assert not evidence.evicts(score) and not drifted and 1.3 < stats.evidence < 1.5
    for _ in range(3):  # passes wear it down
        evidence.judge(stats, [_verdict(True, [CLEAN])] * 8, 0.02)
    assert stats.evidence == 0.0
