"""Benchmark: what serving snapshots costs training (tokens/s with diloco.serve_snapshots on vs off).

After every committed outer step each node builds, in a background thread, a snapshot of its outer
state (params + momentum, sha256 per chunk) and of the averaged update, for peers that catch up. This
runs the same 2-node job with it on and off, alternating, and compares the inner steps' tokens/s.

    python launch/bench/snapshot_cost.py [--config configs/cpu-demo.toml] [--steps 60] [--inner-steps 10] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from launch.cluster import LocalCluster
from prime.data.builtin_corpus import prepare


def run(config: str, serve: bool, args, corpus: Path) -> float:
    overrides = ["--data.path", str(corpus), "--train.max_steps", str(args.steps), "--diloco.inner_steps",
                 str(args.inner_steps), "--train.eval_every", "0", "--checkpoint.every", "0",
                 "--diloco.serve_snapshots", str(serve).lower(), "--diloco.linger_s", "0"]
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(Path(tmp), config, overrides) as c:
        c.run_nodes(["node0", "node1"], 3600)
        # Skip the first round (start-up); every later inner step counts, those overlapping a publish included.
        rates = [r["tokens_per_s"] for n in ("node0", "node1") for r in c.metrics(n)
                 if "loss" in r and r["step"] > args.inner_steps]
    return statistics.median(rates)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="example: python launch/bench/snapshot_cost.py --steps 60")
    parser.add_argument("--config", default="configs/cpu-demo.toml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    corpus = prepare()
    on, off = [], []
    for _ in range(args.repeats):
        on.append(run(args.config, True, args, corpus))
        off.append(run(args.config, False, args, corpus))
        print(f"snapshots on {on[-1]:.0f} tok/s, off {off[-1]:.0f} tok/s, ratio {on[-1] / off[-1]:.3f}", flush=True)
    print(f"{args.config}, 2 nodes, H={args.inner_steps}, {args.steps} steps: median tokens/s with snapshots "
          f"{statistics.median(on):.0f}, without {statistics.median(off):.0f}, ratio "
          f"{statistics.median(on) / statistics.median(off):.3f} (per-round ratios "
          f"{', '.join(f'{a / b:.3f}' for a, b in zip(on, off))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
