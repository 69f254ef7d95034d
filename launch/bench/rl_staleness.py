"""Benchmark: what stale rollouts cost the learning itself, apart from any pipeline.

An async-k run trains, once its pipeline is full, on rollouts of the policy k versions old; how many
versions it then needs to learn the task decides whether its faster versions reach a reward sooner
(launch/bench/rl_async.py measures both together, over processes and an emulated WAN, and one run's
versions to 0.9 there spreads ±30%). Here the reference loop (prime.rl.reference_loop) generates with the policy
of k updates ago in one process, so the only thing that differs between staleness 0 and 2 is the age of
the rollouts: per seed, versions to held-out reward 0.9 (evaluated every 5) for staleness 0, and for
staleness 2 with the default (decoupled) clipping and with plain clipping around the generating version.
Seeds run two at a time, one thread each. Last line:

    rl_staleness: versions to reward 0.9 (median of <n> seeds) — staleness 0 <v>, staleness 2 <v>, staleness 2 plain clipping <v>

    python launch/bench/rl_staleness.py [--seeds 1,2,3,4] [--processes 2] [--max-versions 600]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {  # name -> (staleness, decoupled clipping)
    "staleness 0": (0, True),
    "staleness 2": (2, True),
    "staleness 2 plain clipping": (2, False),
}


def versions_to(policy: str, staleness: int, decoupled: bool, seed: int, max_versions: int, target: float) -> dict:
    """One run of the reference loop until the held-out reward reaches `target`."""
    import torch
    from transformers import AutoTokenizer

    from prime.inference.hf_engine import load_hf_policy
    from prime.rl.environments.reverse import ReverseDigits
    from prime.rl.grpo import ENTROPY_BONUS, GRPOConfig
    from prime.rl.reference_loop import LoopConfig, run

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    config = LoopConfig(steps=max_versions, eval_every=5, staleness=staleness, stop_at_reward=target, seed=seed,
                        grpo=GRPOConfig(entropy_coef=ENTROPY_BONUS, decoupled=decoupled))
    started = time.perf_counter()
    records = run(load_hf_policy(policy), AutoTokenizer.from_pretrained(policy), ReverseDigits(), config,
                  log=lambda _: None)
    evals = [r for r in records if "eval_reward" in r]
    reached = evals[-1]["step"] if evals[-1]["eval_reward"] >= target else None
    entropies = [r["entropy"] for r in records if "entropy" in r]
    return {"versions": reached, "final_reward": evals[-1]["eval_reward"], "seconds": time.perf_counter() - started,
            "entropy_at_end": entropies[-1] if entropies else None}


def _job(args: tuple) -> tuple:
    name, seed, policy, max_versions, target = args
    staleness, decoupled = VARIANTS[name]
    return name, seed, versions_to(policy, staleness, decoupled, seed, max_versions, target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1,2,3,4", help="data and sampling seeds, one run per variant each "
                        "(default 1,2,3,4; the policy is always the digit policy of seed 0)")
    parser.add_argument("--processes", type=int, default=2, help="runs at once, one thread each (default 2)")
    parser.add_argument("--max-versions", type=int, default=600, help="a run that has not reached the target by "
                        "then counts as not reaching it (default 600)")
    parser.add_argument("--target", type=float, default=0.9, help="held-out reward to reach (default 0.9)")
    args = parser.parse_args(argv)
    if args.max_versions < 1 or args.processes < 1 or not 0 < args.target <= 1:
        parser.error("--max-versions and --processes must be at least 1, --target in (0, 1]")
    seeds = [int(s) for s in args.seeds.split(",")]

    from prime.rl.policy import new_digit_policy

    policy = str(new_digit_policy(Path(tempfile.mkdtemp(prefix="rl-staleness-")) / "policy", seed=0))
    jobs = [(name, seed, policy, args.max_versions, args.target) for seed in seeds for name in VARIANTS]
    results: dict[str, dict[int, dict]] = {name: {} for name in VARIANTS}
    with multiprocessing.get_context("spawn").Pool(args.processes) as pool:
        for name, seed, result in pool.imap_unordered(_job, jobs):
            results[name][seed] = result
            print(f"{name}, seed {seed}: {_versions(result['versions'])} versions to {args.target:g} "
                  f"({result['seconds']:.0f} s, entropy at the end {result['entropy_at_end']:.2f})", flush=True)

    medians = {}
    print(f"\n| variant | versions to {args.target:g} per seed ({', '.join(map(str, seeds))}) | median | × staleness 0 |")
    print("|---|---|---|---|")
    for name in VARIANTS:
        versions = [results[name][s]["versions"] for s in seeds]
        medians[name] = _median(versions, args.max_versions)
        base = medians.get("staleness 0")
        ratio = f"{medians[name] / base:.2f}" if medians[name] and base else "—"
        print(f"| {name} | {', '.join(_versions(v) for v in versions)} | {_versions(medians[name])} | {ratio} |")
    print(f"rl_staleness: versions to reward {args.target:g} (median of {len(seeds)} seeds) — "
          + ", ".join(f"{name} {_versions(medians[name])}" for name in VARIANTS))
    return 0


def _median(versions: list[int | None], ceiling: int) -> float | None:
    """A run that never reached the target counts as above every run that did (past the ceiling)."""
    value = statistics.median(ceiling + 1 if v is None else v for v in versions)
    return None if value > ceiling else value


def _versions(value) -> str:
    return "—" if value is None else f"{value:g}"


if __name__ == "__main__":
    sys.exit(main())
