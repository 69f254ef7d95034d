"""Benchmark: TOPLOC proofs and verification on a trained policy, on this machine.

Measured side by side in one run:
- proof size per 32 tokens;
- proof building as a fraction of generation time (warm, batch 16, one thread, completions of 384 and
  of 128 tokens): the engine times its proof work (every step's copy, each chunk's top k, the
  polynomial encoding) inside the same generate;
- verification (one float32 prefill, batch 8) as a fraction of generating those same rollouts;
- honest rollouts under varied batch sizes, thread counts, prompt lengths and sampling: false rejects;
- each attack of prime.testing.toploc_attacks: rollouts rejected by the check that names it;
- how small a weight update the activation check still sees (v-1 claimed as v, one AdamW step at lr);
- then, over time (launch/bench/toploc_workers.py): per worker dtype, the rollouts each attack makes before
  the orchestrator's evidence evicts its worker, and honest evictions; the last line is that part's.

Thresholds come from `prime.verify.calibrate`, run here first on a copy of the policy.

    python launch/bench/toploc.py [--policy DIR] [--rollouts 64] [--lr 1e-5] [--honest 2000]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from prime.inference.engine import GenerationRequest
from prime.inference.hf_engine import HFEngine, eos_id_of, load_hf_policy
from prime.inference.sampling import SamplingParams
from prime.testing.tiny_policy import next_version, tiny_policy_dir
from prime.testing.toploc_attacks import ATTACKS, AttackContext, honest_claims
from prime.verify import calibrate
from prime.verify.calibrate import corpus_prompts, generate_claims
from prime.verify.thresholds import ToplocThresholds
from prime.verify.verifier import Claim, Verifier
from prime.verify.proof import proof_observer


def timing(model, tokenize, verifier: Verifier, eos_id: int, rollouts: int, max_tokens: int) -> tuple[float, float, float]:
    """(proof build share of generation, verify time / generate time, generate tokens/s)."""
    prompts = corpus_prompts(tokenize, rollouts, seed=4242)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_tokens)
    requests = [GenerationRequest(p, seed=77 + i, sampling=sampling) for i, p in enumerate(prompts)]
    engine = HFEngine(model, eos_id=eos_id, observer=proof_observer(verifier.thresholds.proof))
    engine.generate(requests[:16])  # warm-up: tables and allocator
    engine.stats.total_s = engine.stats.proof_s = engine.stats.tokens = 0
    completions = []
    for start in range(0, len(requests), 16):
        completions += engine.generate(requests[start:start + 16])
    claims = [Claim(r.prompt, r.seed, r.sampling, c) for r, c in zip(requests, completions)]
    verifier.verify(claims[:8])  # warm-up
    started = time.perf_counter()
    verdicts = verifier.verify(claims)
    verify_s = time.perf_counter() - started
    if not all(v.accepted for v in verdicts):
        raise SystemExit(f"honest timing rollouts rejected: {[v.reason for v in verdicts if not v.accepted][:2]}")
    return engine.stats.proof_s / engine.stats.total_s, verify_s / engine.stats.total_s, engine.stats.tokens / engine.stats.total_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="TOPLOC: proof size, build and verify cost, false rejects, attacks.")
    parser.add_argument("--policy", type=Path, default=None,
                        help="HF policy directory (default: the built-in tiny trained policy, built once)")
    parser.add_argument("--rollouts", type=int, default=64, help="rollouts per completion length for the timing (default 64)")
    parser.add_argument("--lr", type=float, default=1e-5, help="AdamW lr of the step from v-1 to v (default 1e-5)")
    parser.add_argument("--honest", type=int, default=2000, help="honest rollouts per dtype in the part over time "
                                                                 "(default 2000; 0: skip that part)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        policy = Path(scratch) / "policy"
        shutil.copytree(args.policy or tiny_policy_dir(), policy)
        (policy / "toploc.json").unlink(missing_ok=True)
        started = time.perf_counter()
        if calibrate.main(["--model", str(policy)]) != 0:
            return 2
        print(f"calibration took {time.perf_counter() - started:.0f} s")
        thresholds = ToplocThresholds.load(policy)
        previous = load_hf_policy(policy)
        eos_id = eos_id_of(previous)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(policy, local_files_only=True)
        tokenize = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        model = next_version(previous, lr=args.lr)
        verifier = Verifier(model, thresholds, eos_id=eos_id)

        for length in (384, 128):  # the last one is the headline: short completions are the worst case
            build_share, verify_ratio, tokens_per_s = timing(model, tokenize, verifier, eos_id, args.rollouts, length)
            print(f"completions of {length} tokens: generation {tokens_per_s:.0f} tokens/s (batch 16, 1 thread); "
                  f"proof building {100 * build_share:.2f}% of it; verification {verify_ratio:.3f}× its time")

        honest = honest_claims(model, tokenize, thresholds.proof, eos_id)
        chunks = sum(thresholds.proof.chunks_for(len(c.completion.tokens)) for c in honest)
        false_rejects = [v for v in verifier.verify(honest) if not v.accepted]
        print(f"honest: {len(honest)} rollouts, {chunks} chunks, {len(false_rejects)} rejected")
        for verdict in false_rejects[:3]:
            print(f"  false reject: {verdict.reason}")

        attack_sampling = SamplingParams(temperature=1.0, top_p=0.8, max_tokens=96)
        prompts = corpus_prompts(tokenize, 16, seed=77)
        requests = [GenerationRequest(p, seed=9000 + i, sampling=attack_sampling) for i, p in enumerate(prompts)]
        base = generate_claims(model, requests, 16, 1, thresholds.proof, eos_id=eos_id)
        context = AttackContext(model, previous, base, thresholds.proof, eos_id)
        print(f"{'attack':48s} {'rejected':>9s}  {'named':>6s}  first reason")
        detected = 0
        for attack in ATTACKS:
            forged = attack.forge(context)
            verdicts = verifier.verify(forged)
            rejected = sum(not v.accepted for v in verdicts)
            named = sum(attack.expected_check in v.rejected_by for v in verdicts)
            detected += named == len(forged)
            print(f"{attack.name:48s} {rejected:>4d}/{len(forged):<4d} {named:>4d}    {verdicts[0].reason[:110]}")

        print("v-1 claimed as v, by the size of the step between them (lr of one AdamW step):")
        for lr in (1e-4, 1e-5, 1e-6, 1e-7):
            stepped = next_version(previous, lr=lr)
            probe = Verifier(stepped, thresholds, eos_id=eos_id)
            verdicts = probe.verify(context.regenerate(previous))
            caught = sum("activations" in v.rejected_by for v in verdicts)
            print(f"  lr {lr:g}: {caught}/{len(verdicts)} rejected by the activation check")

    print(f"toploc: proof {thresholds.proof.chunk_bytes} B/32 tok, build overhead {100 * build_share:.2f}%, "
          f"verify/generate {verify_ratio:.3f}, false rejects {len(false_rejects)}/{chunks}, "
          f"attacks detected {detected}/{len(ATTACKS)}")
    if args.honest:
        from launch.bench import toploc_workers
        return toploc_workers.main(["--honest", str(args.honest)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
