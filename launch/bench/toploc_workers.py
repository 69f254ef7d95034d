"""TOPLOC over time: how many rollouts a cheating worker gets before the orchestrator's evidence evicts
it, per worker compute dtype, and how often an honest worker is evicted (issue 51).

The tiny trained policy is calibrated for float32 and bfloat16 workers at once. For each dtype, each
attack of the suite (prime/testing/toploc_attacks.py, computed in that dtype and claimed in it, as a
worker whose token admits that dtype must) plus weights one AdamW step stale at lr 1e-7 and 1e-8 makes
64 rollouts; they are verified by the float32 verifier and fed, 8 to a submission, to the orchestrator's
own evidence (prime/rl/orchestrator/evidence.py). Honest workers of each dtype make --honest rollouts
under varied batch sizes and thread counts; each eviction starts a new worker.

    python launch/bench/toploc_workers.py [--honest 2000]   (also the second part of launch/bench/toploc.py)

Last line:
`toploc_workers: float32 <k>/<K> attacks evicted within <n> rollouts, bfloat16 <k>/<K> within <n>, honest evictions <e> over <N> rollouts`
(n: the median rollouts until eviction of the attacks evicted within 64).
"""

from __future__ import annotations

import argparse
import copy
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from prime.inference.engine import GenerationRequest
from prime.inference.hf_engine import eos_id_of, load_hf_policy
from prime.inference.sampling import SamplingParams
from prime.rl.orchestrator.evidence import RolloutEvidence
from prime.rl.orchestrator.records import WorkerStats
from prime.testing.tiny_policy import next_version, tiny_policy_dir
from prime.testing.toploc_attacks import ATTACKS, HONEST_CONDITIONS, Attack, AttackContext
from prime.verify import calibrate
from prime.verify.calibrate import corpus_prompts, generate_claims, requests_for
from prime.verify.thresholds import ToplocThresholds
from prime.verify.verifier import Claim, Verifier

WITHIN = 64  # rollouts an attack may make
V_LR = 1e-5  # the claimed version v is one AdamW step at this lr from v-1
SUBMISSION = 8  # rollouts per submission, as a lease of the RL demo's shape


def claimed_as(claims: list[Claim], dtype: str) -> list[Claim]:
    return [replace(c, completion=replace(c.completion, compute_dtype=dtype)) for c in claims]


def rollouts_to_eviction(evidence: RolloutEvidence, verdicts: list, bound: float | None, dtype: str) -> int | None:
    stats = WorkerStats()
    for start in range(0, len(verdicts), SUBMISSION):
        score, drifted = evidence.judge(stats, verdicts[start:start + SUBMISSION], bound, dtype)
        stats.verified += sum(v.accepted for v in verdicts[start:start + SUBMISSION])
        if drifted or evidence.evicts(score):
            return min(len(verdicts), start + SUBMISSION)
    return None


def honest_evictions(evidence: RolloutEvidence, verdicts: list, bound: float | None, dtype: str) -> int:
    evictions, stats = 0, WorkerStats()
    for start in range(0, len(verdicts), SUBMISSION):
        score, drifted = evidence.judge(stats, verdicts[start:start + SUBMISSION], bound, dtype)
        if drifted or evidence.evicts(score):
            evictions, stats = evictions + 1, WorkerStats()
    return evictions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="TOPLOC over time: rollouts until a cheating worker is evicted, "
                                                 "honest evictions, per worker dtype.")
    parser.add_argument("--honest", type=int, default=2000, help="honest rollouts per dtype (default 2000)")
    parser.add_argument("--contexts", type=int, default=WITHIN // 16, help="16-rollout attack batches per attack")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    evidence = RolloutEvidence()
    summary: dict[str, tuple[int, int, float | None]] = {}
    honest_total = honest_evicted = 0
    with tempfile.TemporaryDirectory() as scratch:
        policy = Path(scratch) / "policy"
        shutil.copytree(tiny_policy_dir(), policy)
        (policy / "toploc.json").unlink(missing_ok=True)
        if calibrate.main(["--model", str(policy), "--dtypes", "float32,bfloat16"]) != 0:
            return 2
        thresholds = ToplocThresholds.load(policy)
        previous = load_hf_policy(policy)
        eos_id = eos_id_of(previous)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(policy, local_files_only=True)
        tokenize = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        model = next_version(previous, lr=V_LR)
        verifier = Verifier(model, thresholds, eos_id=eos_id)
        # v is one AdamW step (lr 1e-5) from v-1; a first AdamW step moves every weight by about lr, so the
        # step at lr 1e-5 - x ends one step at lr x short of v.
        attacks = [a for a in ATTACKS] + [
            Attack(f"weights one AdamW step stale (lr {lr:g})", "activations",
                   lambda ctx, lr=lr: ctx.regenerate(next_version(previous, lr=V_LR - lr).to(ctx.model.dtype)))
            for lr in (1e-7, 1e-8)]
        sampling = SamplingParams(temperature=1.0, top_p=0.8, max_tokens=96)
        for dtype in ("float32", "bfloat16"):
            bound = thresholds.limits[dtype].deviation_rate
            print(f"{dtype} workers: limits {thresholds.limits[dtype].model_dump()}")
            worker_model = model if dtype == "float32" else copy.deepcopy(model).to(torch.bfloat16)
            worker_previous = previous if dtype == "float32" else copy.deepcopy(previous).to(torch.bfloat16)
            contexts = []
            for k in range(args.contexts):
                prompts = corpus_prompts(tokenize, 16, seed=77 + k)
                requests = [GenerationRequest(p, seed=9000 + 100 * k + i, sampling=sampling)
                            for i, p in enumerate(prompts)]
                honest = generate_claims(worker_model, requests, 16, 1, thresholds.proof, eos_id=eos_id)
                contexts.append(AttackContext(worker_model, worker_previous, claimed_as(honest, dtype),
                                              thresholds.proof, eos_id))
            evicted_at = []
            print(f"  {'attack':48s} {'pass one by one':>16s}  evicted after")
            for attack in attacks:
                if dtype != "float32" and attack.name.startswith("bf16 compute"):
                    continue  # a bfloat16 worker claiming float32 is refused as malformed (its token says bfloat16)
                forged = claimed_as([c for ctx in contexts for c in attack.forge(ctx)], dtype)[:WITHIN]
                verdicts = verifier.verify(forged)
                at = rollouts_to_eviction(evidence, verdicts, bound, dtype)
                evicted_at.append(at)
                print(f"  {attack.name:48s} {sum(v.accepted for v in verdicts):>7d}/{len(verdicts):<8d} "
                      f"{at if at is not None else f'not within {len(verdicts)}'}")
            caught = [n for n in evicted_at if n is not None]
            summary[dtype] = (len(caught), len(evicted_at), statistics.median(caught) if caught else None)
            claims: list[Claim] = []
            round_ = 0
            while len(claims) < args.honest:
                batch_size, threads = HONEST_CONDITIONS[round_ % len(HONEST_CONDITIONS)]
                prompts = corpus_prompts(tokenize, 2 * batch_size, seed=5000 + round_)
                requests = requests_for(prompts, seed=7000 + round_, max_tokens=128)
                claims += claimed_as(generate_claims(worker_model, requests, batch_size, threads, thresholds.proof,
                                                     eos_id=eos_id), dtype)
                round_ += 1
            claims = claims[:args.honest]
            verdicts = verifier.verify(claims)
            rejected = sum(not v.accepted for v in verdicts)
            chunks = sum(len(v.chunks) for v in verdicts)
            differing = sum(c.deviates for v in verdicts for c in v.chunks)
            evictions = honest_evictions(evidence, verdicts, bound, dtype)
            honest_total, honest_evicted = honest_total + len(claims), honest_evicted + evictions
            print(f"  honest: {len(claims)} rollouts, {rejected} rejected one by one ({rejected / len(claims):.2%}), "
                  f"{differing} of {chunks} chunks differ ({differing / max(1, chunks):.2%}; bound "
                  f"{bound if bound is None else f'{bound:.1%}'}), {evictions} evictions")
    print(f"took {time.perf_counter() - started:.0f} s")
    parts = [f"{dtype} {k}/{n} attacks evicted within {median if median is None else f'{median:g}'} rollouts"
             if dtype == "float32" else f"{dtype} {k}/{n} within {median if median is None else f'{median:g}'}"
             for dtype, (k, n, median) in summary.items()]
    print(f"toploc_workers: {', '.join(parts)}, honest evictions {honest_evicted} over {honest_total} rollouts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
