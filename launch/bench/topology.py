"""Benchmark: the all-reduce with its ring in rank order against the ring chosen from measured link
rates, side by side, on an emulated topology where some routes between nodes are slow.

Every member sits behind the same access link; the routes between the pairs given by --slow (both
directions) are slower (--route-mbit, --route-latency-ms more). Rank order puts a slow route in the
ring; the measured ring (elastic_mesh/wire/topology.py) should avoid it after one all-reduce has measured
the pairs. Runs alternate fixed / measured; the first measured run is the one that measures (it still
uses rank order), so it is reported on its own and left out of the median.

With --train, the same comparison on whole outer steps: nodes of a small model train under the same
kind of topology (plus a coordinator host), once with mesh.ring_order = rank and once = measured, and
the median outer step (all-reduce and the coordinator's round trips) after the first is compared.

    python launch/bench/topology.py [--nodes 4] [--mb 20] [--mbit 20] [--slow 0-1] [--route-mbit 4] [--repeats 3]
    python launch/bench/topology.py --train --mbit 5 --route-mbit 1 [--steps 60] [--inner-steps 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

import tempfile

from elastic_mesh.wire.topology import hop_rates
from launch.cluster import LocalCluster
from launch.wan.harness import LinkProfile, PathProfile, WanTopology
from prime.data.builtin_corpus import prepare

# A model whose int8 pseudo-gradient (1.5 MB) takes seconds on a few Mbit/s, with inner steps that
# 4 nodes can run on 2 cores.
TRAIN_MODEL = ["--model.hidden_size", "256", "--model.intermediate_size", "512", "--model.num_layers", "2",
               "--model.num_heads", "4", "--model.num_kv_heads", "2"]


def train(nodes: int, steps: int, inner_steps: int, access: LinkProfile, slow: list[tuple[int, int]],
          route: PathProfile) -> dict[str, list[dict]]:
    """Outer-step records of node0 for a run with each ring order, under one topology."""
    names = [f"node{i}" for i in range(nodes)]
    paths = {(names[a], names[b]): route for a, b in slow}
    overrides = ["--data.path", str(prepare()), "--train.max_steps", str(steps), "--diloco.inner_steps",
                 str(inner_steps), "--train.eval_every", "0", "--checkpoint.every", "0",
                 "--mesh.transfer_timeout_s", "120", *TRAIN_MODEL]
    records = {}
    with WanTopology(["coordinator", *names], access, paths=paths) as wan, tempfile.TemporaryDirectory() as tmp:
        print(wan.describe(), flush=True)
        for order in ("rank", "measured"):
            with LocalCluster(Path(tmp) / order, "configs/debug.toml", [*overrides, "--mesh.ring_order", order],
                              wan=wan, coordinator_args=["--min-wait-s", "60"]) as c:
                c.run_nodes(names, 3600, in_order=True)  # ranks follow the names: rank order meets the slow route
                records[order] = [r for _, r in sorted(c.outer_records("node0").items())]
                rings = [line.split("ring is now ", 1)[1] for line in c.log("node0").splitlines() if "ring is now" in line]
                print(f"ring_order={order}: {len(records[order])} outer steps; ring changes: {rings or 'none'}",
                      flush=True)
        records["backend"] = wan.backend
    return records


def run(nodes: int, mb: float, repeats: int, access: LinkProfile, slow: list[tuple[int, int]],
        route: PathProfile) -> dict:
    """Both rings over the same topology, alternating; the worker's results plus the backend used."""
    hosts = [f"m{i}" for i in range(nodes)]
    paths = {(hosts[a], hosts[b]): route for a, b in slow}
    with WanTopology(hosts, access, paths=paths) as wan:
        print(wan.describe(), flush=True)
        master = f"{wan.address('m0')}:29556"
        settings = json.dumps({"streams": [1], "fp32": False, "rings": ["fixed", "measured"]})
        procs = [subprocess.Popen(wan.exec_prefix(h) + [sys.executable, str(REPO / "launch/bench/allreduce_worker.py"),
                                                        str(i), str(nodes), master, str(mb), str(repeats + 1),
                                                        wan.interface(), settings],
                                  stdout=subprocess.PIPE, text=True) for i, h in enumerate(hosts)]
        out = procs[0].communicate(timeout=3600)[0]
        for p in procs[1:]:
            p.wait(timeout=600)
        if any(p.returncode for p in procs):
            raise RuntimeError(f"a member failed: return codes {[p.returncode for p in procs]}")
        results = json.loads(out.strip().splitlines()[-1])
        results["backend"] = wan.backend
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n")[-1])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--mb", type=float, default=20.0, help="fp32 megabytes per member")
    parser.add_argument("--mbit", type=float, default=20.0, help="access link rate of every member, both ways")
    parser.add_argument("--latency-ms", type=float, default=10.0, help="one-way latency of every access link")
    parser.add_argument("--slow", default="0-1", help="pairs with a slow route between them, e.g. 0-1,2-3")
    parser.add_argument("--route-mbit", type=float, default=4.0, help="rate of a slow route")
    parser.add_argument("--route-latency-ms", type=float, default=30.0, help="extra one-way latency of a slow route")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each ring (after one measuring run)")
    parser.add_argument("--train", action="store_true", help="compare whole outer steps of training nodes instead")
    parser.add_argument("--steps", type=int, default=60, help="--train: inner steps per run")
    parser.add_argument("--inner-steps", type=int, default=10, help="--train: H")
    args = parser.parse_args()
    slow = [tuple(int(v) for v in pair.split("-")) for pair in args.slow.split(",") if pair]
    access = LinkProfile(latency_ms=args.latency_ms, up_mbit=args.mbit, down_mbit=args.mbit)
    route = PathProfile(latency_ms=args.route_latency_ms, mbit=args.route_mbit)
    if args.train:
        records = train(args.nodes, args.steps, args.inner_steps, access, slow, route)
        print(f"{args.nodes} nodes, H={args.inner_steps}, {args.steps} steps, {args.mbit:g} Mbit/s access links, "
              f"slow routes {args.slow} at {args.route_mbit:g} Mbit/s +{args.route_latency_ms:g} ms "
              f"(backend {records.pop('backend')}); median over outer steps 2 and later:")
        medians = {}
        for order, rows in records.items():
            later = rows[1:]
            medians[order] = statistics.median(r["outer_s"] for r in later)
            print(f"  ring_order={order}: outer step {medians[order]:.2f} s, of which all-reduce "
                  f"{statistics.median(r['allreduce_s'] for r in later):.2f} s")
        print(f"speed-up of the measured ring per outer step: {medians['rank'] / medians['measured']:.2f}x")
        return 0
    results = run(args.nodes, args.mb, args.repeats, access, slow, route)
    fixed = results["prime_int8_fixed_x1"][1:]
    measuring, measured = results["prime_int8_measured_x1"][0], results["prime_int8_measured_x1"][1:]
    rings = results["prime_int8_measured_x1_rings"]
    rates = results.get("rates")
    print(f"{args.nodes} members, {args.mb:g} MB fp32 each, {args.mbit:g} Mbit/s access links, slow routes "
          f"{args.slow} at {args.route_mbit:g} Mbit/s +{args.route_latency_ms:g} ms (backend {results['backend']}); "
          f"median of {args.repeats}")
    if rates:
        print("measured rates, Mbit/s (row: from, column: to):")
        for i, row in enumerate(rates):
            print(f"  m{i}: " + " ".join(f"{v * 8 / 1e6:6.2f}" if i != j else "     -" for j, v in enumerate(row)))
        for name, ring in (("rank order", list(range(args.nodes))), ("measured", rings[-1])):
            print(f"{name} ring {' -> '.join(f'm{r}' for r in ring)}: slowest hop "
                  f"{min(hop_rates(ring, rates)) * 8 / 1e6:.2f} Mbit/s (estimated)")
    print(f"rings used by the measured runs: {rings}")
    print(f"rank-order ring: {statistics.median(fixed):.2f} s; measured ring: {statistics.median(measured):.2f} s "
          f"(the measuring run, still in rank order: {measuring:.2f} s)")
    print(f"speed-up of the measured ring: {statistics.median(fixed) / statistics.median(measured):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
