"""Benchmark: final eval loss of the same multi-node run under several outer-loop settings, side by side.

Each variant is a set of `--section.key value` flags; every variant trains the same nodes (a local
cluster on loopback: loss does not depend on the network) for the same steps, and the final eval loss
of node0 is printed per variant. For choosing diloco.mode / outer momentum / eager on a model quickly.

    python launch/bench/outer_modes_loss.py [--config configs/debug.toml] [--steps 200] [--inner-steps 10] \\
        "--diloco.mode blocking" "--diloco.mode delayed --diloco.outer_momentum 0.5" ...
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from launch.cluster import LocalCluster
from prime.data.builtin_corpus import prepare


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n")[-1])
    parser.add_argument("variants", nargs="+", help="flags of one variant, quoted (e.g. \"--diloco.mode delayed\")")
    parser.add_argument("--config", default="configs/debug.toml")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--inner-steps", type=int, default=10)
    args = parser.parse_args()
    corpus = prepare()
    rows = []
    for variant in args.variants:
        overrides = ["--data.path", str(corpus), "--train.max_steps", str(args.steps), "--diloco.inner_steps",
                     str(args.inner_steps), "--train.eval_every", "0", "--checkpoint.every", "0", *variant.split()]
        with tempfile.TemporaryDirectory() as tmp, LocalCluster(Path(tmp), args.config, overrides,
                                                                coordinator_args=["--min-wait-s", "30"]) as c:
            c.run_nodes([f"node{i}" for i in range(args.nodes)], 3600)
            rows.append((variant, [r["eval_loss"] for r in c.metrics("node0") if "eval_loss" in r][-1]))
            print(f"{variant:<72} eval loss {rows[-1][1]:.4f}", flush=True)
    print(f"\n{args.config}, {args.nodes} nodes, H={args.inner_steps}, {args.steps} steps; ratio to the first variant:")
    for variant, loss in rows:
        print(f"{variant:<72} {loss:.4f}  {loss / rows[0][1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
