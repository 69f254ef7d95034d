"""Benchmark: compute utilisation of blocking DiLoCo across an emulated WAN.

The same nodes (each in its own namespace behind the chosen profile) train the same config twice:
once as a DiLoCo run (int8 all-reduce every H steps over the WAN), once with communication switched
off (each node trains alone, no coordinator). Utilisation = tokens/s with communication / tokens/s
without, measured over the same number of inner steps. INTELLECT-1: 83% globally, 96% in the US.

    python launch/bench/utilisation.py [--profile global] [--nodes 2] [--steps 100] [--inner-steps 25]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from launch.cluster import LocalCluster, child_env  # noqa: E402
from launch.wan import PROFILES, WanTopology  # noqa: E402
from prime.data.builtin_corpus import prepare  # noqa: E402


def tokens_per_s(cluster: LocalCluster, names: list[str]) -> float:
    total, spans = 0, []
    for name in names:
        steps = [r for r in cluster.metrics(name) if "loss" in r]
        total += steps[-1]["tokens"] - steps[0]["tokens"]
        spans.append(steps[-1]["time"] - steps[0]["time"])
    return total / max(spans)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="example: python launch/bench/utilisation.py --profile global --steps 100")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="global")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--inner-steps", type=int, default=25)
    parser.add_argument("--config", default="configs/cpu-demo.toml")
    args = parser.parse_args()
    corpus = prepare()
    names = [f"node{i}" for i in range(args.nodes)]
    overrides = ["--data.path", str(corpus), "--train.max_steps", str(args.steps), "--diloco.inner_steps",
                 str(args.inner_steps), "--train.eval_every", "0", "--checkpoint.every", "0",
                 "--mesh.transfer_timeout_s", "120"]
    rates = {}
    with WanTopology(["coordinator", *names], args.profile) as wan, tempfile.TemporaryDirectory() as tmp:
        print(wan.describe(), flush=True)
        with LocalCluster(Path(tmp) / "diloco", args.config, overrides, wan=wan,
                          coordinator_args=["--min-wait-s", "60"]) as c:
            c.start_coordinator(start_nodes=args.nodes)
            for name in names:
                c.start_node(name)
            if any(code != 0 for code in c.wait_nodes(3600).values()):
                raise SystemExit(c.log("node0")[-2000:])
            rates["diloco"] = tokens_per_s(c, names)
            outer = [r for r in c.outer_records("node0").values()]
            allreduce = sum(r["allreduce_s"] for r in outer)
        # Communication off: the same processes in the same namespaces, no --join.
        solo = LocalCluster(Path(tmp) / "solo", args.config, overrides, wan=wan)
        procs = []
        for name in names:
            run_dir = Path(tmp) / "solo" / name
            cmd = [*wan.exec_prefix(name), str(Path(sys.executable).parent / "torchrun"), "--standalone",
                   "--nproc-per-node=1", "-m", "prime.train", "--config", args.config, "--run-dir", str(run_dir),
                   "--quiet", *overrides]
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
        for p in procs:
            p.wait(timeout=3600)
        rates["solo"] = tokens_per_s(solo, names)
    print(f"{args.nodes} nodes, {args.config}, H={args.inner_steps}, {args.steps} inner steps, profile "
          f"{args.profile} (backend {wan.backend})")
    print(f"tokens/s with DiLoCo over the WAN: {rates['diloco']:.0f}; with communication off: {rates['solo']:.0f}")
    print(f"compute utilisation: {rates['diloco'] / rates['solo'] * 100:.1f}% "
          f"({len(outer)} outer steps, {allreduce:.1f} s in all-reduces on node0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
