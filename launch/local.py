"""A whole simulated cluster on this machine: one coordinator and N nodes, each its own torchrun.

    python launch/local.py --nodes 3 --config configs/cpu-demo.toml [--run-dir DIR] [--section.key VALUE ...]

Everything lands under the run directory: coordinator/ (SQLite state, log), nodeK/ (metrics.jsonl,
log). Node output is streamed with a [nodeK] prefix. Ctrl-C stops the nodes (they announce that they
leave) and then the coordinator.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from launch.cluster import REPO, LocalCluster


def summarize(cluster: LocalCluster, names: list[str]) -> bool:
    print(f"\nrun directory: {cluster.run_dir}")
    hashes = {}
    for name in names:
        records = cluster.metrics(name)
        losses = [r["loss"] for r in records if "loss" in r]
        evals = [r["eval_loss"] for r in records if "eval_loss" in r]
        outer = cluster.outer_records(name)
        hashes[name] = {k: r["model_hash"] for k, r in outer.items()}
        if losses:
            print(f"  {name}: {len(losses)} inner steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}"
                  + (f", eval loss {evals[0]:.3f} -> {evals[-1]:.3f}" if evals else "")
                  + f", {len(outer)} outer steps")
        else:
            print(f"  {name}: no metrics (see {cluster.run_dir / name / 'log'})")
    common = set.intersection(*(set(h) for h in hashes.values())) if hashes else set()
    same = all(len({h[s] for h in hashes.values()}) == 1 for s in common)
    print(f"  outer steps committed by every node: {len(common)}; models bit-identical at each: {same}")
    return same


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description="Run a coordinator and N DiLoCo nodes on this machine.",
                                     epilog="example: python launch/local.py --nodes 3 --config configs/cpu-demo.toml "
                                            "--train.max_steps 100   (any --section.key VALUE goes to every node)")
    parser.add_argument("--nodes", type=int, default=2, help="number of nodes (default 2)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="local ranks per node (default 1)")
    parser.add_argument("--config", default="configs/cpu-demo.toml")
    parser.add_argument("--run-dir", type=Path, default=None, help="default runs/local-TIMESTAMP")
    parser.add_argument("--late", action="append", default=[], metavar="NODE:SECONDS",
                        help="start node NODE (0-based) this many seconds late, e.g. 2:60 (repeatable)")
    parser.add_argument("--node-arg", action="append", default=[], metavar="NODE:ARG",
                        help="an argument for one node only, e.g. 1:--chaos.kill_at_inner_step=30 (repeatable)")
    parser.add_argument("--coordinator-arg", action="append", default=[], metavar="ARG",
                        help="passed to the coordinator, e.g. --coordinator-arg=--lease-s=4")
    parser.add_argument("--show-steps", action="store_true", help="stream every inner-step log line too")
    args, overrides = parser.parse_known_args()
    if args.nodes < 1:
        parser.error("--nodes must be at least 1")
    run_dir = args.run_dir or REPO / "runs" / time.strftime("local-%Y%m%d-%H%M%S")
    late = {int(k): float(v) for k, v in (item.split(":", 1) for item in args.late)}
    per_node: dict[int, list[str]] = {}
    for item in args.node_arg:
        index, arg = item.split(":", 1)
        per_node.setdefault(int(index), []).append(arg)

    # `kill` of this launcher stops the cluster the same way Ctrl-C does, instead of orphaning it.
    signal.signal(signal.SIGTERM, _interrupt)
    names = [f"node{i}" for i in range(args.nodes)]
    cluster = LocalCluster(run_dir, args.config, overrides, args.nproc_per_node, args.coordinator_arg,
                           echo=True, show_steps=args.show_steps)
    with cluster:
        cluster.start_coordinator(start_nodes=args.nodes - len(late))
        print(f"coordinator on 127.0.0.1:{cluster.port}; observer token: {cluster.token[:24]}... (each node has its own)")
        print(f"dashboard: http://127.0.0.1:{cluster.port}/#token={cluster.token}")
        started = time.monotonic()
        pending = sorted(range(args.nodes), key=lambda i: late.get(i, 0))
        try:
            while pending or any(p.poll() is None for p in cluster.nodes.values()):
                while pending and time.monotonic() - started >= late.get(pending[0], 0):
                    i = pending.pop(0)
                    cluster.start_node(names[i], per_node.get(i))
                time.sleep(0.2)
        except KeyboardInterrupt:
            print("\nstopping nodes (they announce that they leave)...")
            for name, proc in cluster.nodes.items():
                if proc.poll() is None:
                    cluster.kill_node(name, signal.SIGTERM)
            cluster.wait_nodes(60)
        codes = {n: p.poll() for n, p in cluster.nodes.items()}
        same = summarize(cluster, names)
    failed = {n: c for n, c in codes.items() if c not in (0, None)}
    if failed:
        print(f"nodes that exited with an error: {failed}")
    return 1 if failed or not same else 0


if __name__ == "__main__":
    sys.exit(main())
