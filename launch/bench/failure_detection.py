"""Benchmark: time from a SIGKILL of one node to the survivors' next committed outer step.

Each trial starts a fresh local cluster (coordinator + N nodes, debug-sized model, H inner steps),
lets it commit a few outer steps, SIGKILLs one node at a random moment of its inner steps or of an
outer step, and measures from the kill to the first outer step the survivors commit without it. Each
trial runs twice, side by side: with the node's lifeline (the coordinator sees the killed process's
connection close) and with the coordinator's --lease-only (it waits for the lease to run out). The
rest of the round and the retry come on top of either.

    python launch/bench/failure_detection.py [--trials 3] [--nodes 3] [--lease-s 6]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from launch.cluster import LocalCluster
from prime.data.builtin_corpus import prepare


def trial(corpus: Path, nodes: int, lease_s: float, rng: random.Random, lease_only: bool) -> tuple[float, float]:
    overrides = ["--data.path", str(corpus), "--train.max_steps", "400", "--diloco.inner_steps", "10",
                 "--train.eval_every", "0", "--checkpoint.every", "0", "--chaos.step_delay_s", "0.05"]
    names = [f"node{i}" for i in range(nodes)]
    with tempfile.TemporaryDirectory() as run_dir, LocalCluster(
            Path(run_dir), "configs/debug.toml", overrides,
            coordinator_args=["--lease-s", str(lease_s), "--heartbeat-s", str(lease_s / 6), "--min-wait-s", "5",
                              *(["--lease-only"] if lease_only else [])]) as c:
        c.start_coordinator(start_nodes=nodes)
        for name in names:
            c.start_node(name)
        while len(c.outer_records("node0")) < 3:
            time.sleep(0.1)
        time.sleep(rng.uniform(0, 1.5))  # somewhere in a round
        killed_at = time.time()
        c.kill_node(names[-1])
        deadline = time.monotonic() + 300
        while True:
            after = [r for r in c.outer_records("node0").values() if r["time"] > killed_at and r["nodes"] == nodes - 1]
            if after:
                return min(r["time"] for r in after) - killed_at, after[0]["allreduce_s"]
            if time.monotonic() > deadline:
                raise RuntimeError("survivors did not commit within 300 s")
            time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="example: python launch/bench/failure_detection.py --trials 3")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--lease-s", type=float, default=6.0)
    args = parser.parse_args()
    corpus = prepare()
    times: dict[str, list[float]] = {"lifeline": [], "lease only": []}
    for i in range(args.trials):
        for mode in times:  # the same random moment of the round for both
            seconds, _ = trial(corpus, args.nodes, args.lease_s, random.Random(i), lease_only=mode == "lease only")
            times[mode].append(seconds)
            print(f"trial {i} {mode}: SIGKILL -> next committed outer step without the node: {seconds:.2f} s",
                  flush=True)
    for mode, values in times.items():
        print(f"{mode}: median {statistics.median(values):.2f} s, max {max(values):.2f} s over {args.trials} trials")
    lifeline, lease = statistics.median(times["lifeline"]), statistics.median(times["lease only"])
    print(f"failure detection: {args.nodes} nodes, lease {args.lease_s:g} s, round ≈ 1 s: lifeline {lifeline:.2f} s, "
          f"lease only {lease:.2f} s, {lease / lifeline:.1f}x sooner")
    return 0


if __name__ == "__main__":
    sys.exit(main())
