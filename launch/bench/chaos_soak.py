"""Chaos soak: a local cluster takes ≥ 100 faults, one after another, while it trains.

Faults (launch/fault_injector.py): SIGKILL in the inner steps, SIGKILL between the phases of an all-reduce,
SIGKILL of a node that is joining, SIGKILL of a node while a joiner downloads from it, a node that
serves snapshot chunks with a bit flipped while a joiner downloads from it, a short stall (SIGSTOP under the lease), a long stall (over the
lease: declared dead, must rejoin by itself), a slowed node (50% duty for twice the lease), a coordinator kill
and restart, a NaN pseudo-gradient, hostile bytes on every listening port, a forged token, and with
--wan a partition (the node's link down for longer than the lease, then healed). Killed nodes are
restarted and rejoin. Prints, per kind and in total: faults injected and survived, outer steps
committed, replicas that diverged, hangs, nodes that crashed on their own, the longest time from
a fault to the next committed outer step, and data lost or duplicated (prime.tools.audit over the
coordinator's ledger: every document counted by id).

    python launch/bench/chaos_soak.py [--faults 100] [--nodes 3] [--wan lan] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from launch.cluster import LocalCluster
from launch.fault_injector import FaultInjector
from prime.data.builtin_corpus import prepare

LEASE_S = 3.0
JOINER_HOSTS = 3
KINDS = ["kill", "kill-in-allreduce", "kill-while-joining", "kill-while-serving", "corrupt-chunk", "short-stall",
         "long-stall", "throttle", "coordinator-restart", "nan-pseudo-gradient", "hostile-input", "forged-token"]


class Observer:
    """Reads the coordinator's SQLite (read-only): it stays readable while the coordinator is down."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.path = cluster.state_dir / "coordinator.sqlite"

    def _query(self, sql: str) -> list:
        db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=5)
        try:
            return db.execute(sql).fetchall()
        finally:
            db.close()

    def committed(self) -> int:
        return self._query("SELECT COALESCE(MAX(round), 0) FROM rounds WHERE decision = 'apply'")[0][0]

    def in_sync(self) -> int:
        """Live nodes that hold the last committed step."""
        return self._query("SELECT COUNT(*) FROM nodes WHERE state = 'active' AND round = "
                           "(SELECT COALESCE(MAX(round), 0) FROM rounds WHERE decision = 'apply')")[0][0]

    def diverged_events(self) -> int:
        return self._query("SELECT COUNT(*) FROM events WHERE text LIKE '%diverged%'")[0][0]


class CommitWatcher:
    """Notes when each outer step commits (polled every 50 ms in the background), so the time from a
    fault to the next commit is measured from the fault's start even while injecting takes a while."""

    def __init__(self, observer: Observer) -> None:
        self.observer = observer
        self.commits: list[tuple[float, int]] = []  # (monotonic time first seen, committed step)
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        last = 0  # step 0 is the start, not a commit
        while not self._stop.wait(0.05):
            try:
                step = self.observer.committed()
            except sqlite3.Error:
                continue  # mid-write; the next poll sees it
            if step > last:
                self.commits.append((time.monotonic(), step))
                last = step

    def latest(self) -> int:
        return self.commits[-1][1] if self.commits else 0

    def next_commit(self, after_time: float, timeout_s: float) -> float | None:
        """Seconds from after_time to the first commit seen after it, or None (a hang)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            later = [t for t, _ in self.commits if t > after_time]
            if later:
                return later[0] - after_time
            time.sleep(0.05)
        return None

    def stop(self) -> None:
        self._stop.set()


def soak(args) -> dict:
    corpus = prepare()
    names = [f"node{i}" for i in range(args.nodes)]
    overrides = ["--data.path", str(corpus), "--train.max_steps", "1000000", "--diloco.inner_steps", "5",
                 "--train.eval_every", "0", "--checkpoint.every", "0", "--chaos.step_delay_s", "0.05",
                 "--mesh.transfer_timeout_s", "10", "--train.log_every", "1000",
                 # the debug model's 1 MB state in 32 chunks, so every source serves some of a joiner's download
                 "--mesh.chunk_bytes", "32768"]
    wan = None
    if args.wan:
        from launch.wan.harness import WanTopology

        wan = WanTopology(["coordinator", *names, *[f"joiner{i}" for i in range(JOINER_HOSTS)]], args.wan).up()
        print(wan.describe().split(";")[0])
    rng = random.Random(args.seed)
    kinds = list(args.kinds or KINDS) + (["partition"] if wan else [])
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="prime-soak-"))
    cluster = LocalCluster(run_dir, "configs/debug.toml", overrides, wan=wan, coordinator_args=[
        "--lease-s", str(LEASE_S), "--heartbeat-s", "0.5", "--min-wait-s", "2"])
    injector, observer = FaultInjector(cluster, wan, args.seed), Observer(cluster)
    watcher = None
    results: dict[str, list] = defaultdict(list)  # kind -> recovery seconds (None = hang)
    crashed, joiners, not_injected, slow_recoveries = 0, 0, 0, 0
    failed: list[str] = []  # faults whose own check failed (a joiner that did not get past a bad source)
    full_strength: list[float] = []  # seconds from the end of a fault's effects to all nodes in sync again
    phases: dict[str, float] = defaultdict(float)  # where the soak's wall-clock time goes, summed over faults
    started = time.monotonic()
    try:
        cluster.start_coordinator(start_nodes=args.nodes)
        for name in names:
            injector.start_node(name)
        watcher = CommitWatcher(observer)
        if watcher.next_commit(time.monotonic() - 1e9, 300) is None:
            raise RuntimeError(f"the cluster never committed an outer step; see {run_dir}")
        i, last_kind = 0, "start"
        while i < args.faults and not_injected <= args.faults:
            # Every node back and running before the next fault; one that died on its own is a crash.
            for name in names:
                code = cluster.nodes[name].poll()
                if code is not None:
                    if code not in (-9, 137):
                        crashed += 1
                        print(f"  {name} exited with {code} on its own; see {run_dir / name / 'log'}")
                    injector.start_node(name)
            # Back to full strength (every node holds the newest step) before the next fault: faults come one
            # at a time. Otherwise a run of faults can take out every holder of the state, which no replica
            # scheme survives without a checkpoint.
            phase = recovering = time.monotonic()
            # One reading decides: asked twice, a commit in between (one node's hash a moment behind the
            # others') read as "not back" a wait that had just ended in sync (1000-fault soak, fault 366).
            while (in_sync := observer.in_sync()) < args.nodes and time.monotonic() - recovering < args.hang_s:
                time.sleep(0.2)
            if in_sync < args.nodes:
                slow_recoveries += 1
                print(f"  not back to {args.nodes} nodes in sync within {args.hang_s:.0f} s", flush=True)
            full_strength.append(time.monotonic() - recovering)
            phase = _lap(phases, f"back to full strength after {last_kind}", phase)
            watcher.next_commit(time.monotonic(), 120)  # running again before the next fault
            phase = _lap(phases, "a commit before the fault", phase)
            kind = kinds[i % len(kinds)] if args.every_kind_in_turn else rng.choice(kinds)
            target = rng.choice(names)
            hold_s = {"short-stall": LEASE_S / 2, "long-stall": LEASE_S + 2, "throttle": 2 * LEASE_S,
                      "partition": LEASE_S + 2}.get(kind, 0.0)
            try:
                if kind == "kill":
                    time.sleep(rng.uniform(0, 1.0))
                    injector.kill(target)
                elif kind == "kill-in-allreduce":
                    injector.kill_in_allreduce(target)
                elif kind in ("kill-while-joining", "kill-while-serving", "corrupt-chunk"):
                    joiners += 1
                    joiner = f"joiner{joiners % JOINER_HOSTS}"  # a few hosts, reused: each joiner dies anyway
                    if kind == "kill-while-joining":
                        injector.kill_while_joining(target := joiner)
                    elif kind == "kill-while-serving":
                        injector.kill_while_serving(target, joiner)
                    else:
                        injector.corrupt_chunk(target, joiner)
                elif kind in ("short-stall", "long-stall"):
                    injector.pause(target, hold_s)
                elif kind == "throttle":
                    injector.throttle(target, hold_s)
                elif kind == "coordinator-restart":
                    injector.restart_coordinator(down_s=rng.uniform(0.5, 3))
                elif kind == "nan-pseudo-gradient":
                    injector.poison(target)
                elif kind == "hostile-input":
                    injector.hostile_input()
                elif kind == "forged-token":
                    injector.forged_token()
                elif kind == "partition":
                    injector.partition(target)
            except RuntimeError as e:  # the harness could not inject it (not a failure of the cluster)
                print(f"fault {i + 1:3d}/{args.faults}: {kind:<20} could not be injected: {e}", flush=True)
                not_injected += 1
                continue  # not counted: the next fault takes its number
            i += 1
            phase = _lap(phases, f"injecting ({kind})", phase)
            fault = injector.faults[-1]
            recovery = watcher.next_commit(fault.at, args.hang_s)
            phase = _lap(phases, "fault to next commit", phase)
            results[kind].append(recovery if not fault.failed else None)
            if fault.failed:
                failed.append(f"{kind}: {fault.failed}")
            print(f"fault {i:3d}/{args.faults}: {kind:<20} {fault.target:<12} "
                  + (f"next commit after {recovery:5.1f} s" if recovery is not None else "HANG: no commit")
                  + f" (outer step {watcher.latest()})" + (f" {fault.detail}" if "joiner" in fault.detail else "")
                  + (f" FAILED: {fault.failed}" if fault.failed else ""), flush=True)
            time.sleep(max(0.0, fault.at + hold_s - time.monotonic()))  # the fault runs its course
            if kind == "partition":
                injector.heal(target)
            _lap(phases, f"the course of {kind}", phase)
            last_kind = kind
        committed = observer.committed()
        diverged_events = observer.diverged_events()
    finally:
        if watcher:
            watcher.stop()
        cluster.stop()
        if wan:
            wan.down()
    hashes: dict[int, set[str]] = defaultdict(set)
    for path in run_dir.glob("*/metrics.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "outer_step" in record:
                hashes[record["outer_step"]].add(record["model_hash"])
    diverged = sorted(s for s, h in hashes.items() if len(h) > 1)
    data = audit_data(cluster, corpus)
    recoveries = [r for rs in results.values() for r in rs if r is not None]
    return {"faults": sum(len(v) for v in results.values()),
            "survived": len(recoveries), "failed": failed,
            "hangs": sum(r is None for rs in results.values() for r in rs) - len(failed),
            "crashed": crashed, "not_injected": not_injected, "slow_recoveries": slow_recoveries,
            "longest_back_to_full_strength_s": round(max(full_strength, default=0), 1),
            "outer_steps_committed": committed, "diverged_steps": len(diverged),
            "diverged_events": diverged_events, "longest_fault_to_commit_s": round(max(recoveries), 2),
            "median_fault_to_commit_s": round(statistics.median(recoveries), 2),
            "by_kind": {k: {"injected": len(v), "survived": sum(r is not None for r in v),
                            "longest_s": round(max([r for r in v if r is not None], default=0), 2)}
                        for k, v in sorted(results.items())},
            "minutes": round((time.monotonic() - started) / 60, 1), "run_dir": str(run_dir),
            "wan": args.wan or "none (loopback)", "data": data,
            "seconds_by_phase": {k: round(v, 1) for k, v in sorted(phases.items(), key=lambda kv: -kv[1])}}


def _lap(phases: dict[str, float], name: str, since: float) -> float:
    now = time.monotonic()
    phases[name] += now - since
    return now


def audit_data(cluster: LocalCluster, corpus: Path) -> dict:
    """Every document read by a committed outer step, counted by id against the shard files."""
    from prime.data.shards import make_shards
    from prime.data.tokenizer import ByteTokenizer
    from prime.tools.audit import audit_ledger

    shards = make_shards(sorted(str(p) for p in corpus.glob("train-*.jsonl")), 1)
    report = audit_ledger(cluster.state_dir / "coordinator.sqlite", shards, ByteTokenizer())
    return {"ok": report.ok, "documents": report.documents, "tokens": report.tokens, "ranges": report.ranges,
            "duplicated": len(report.duplicated), "incomplete": len(report.partial),
            "gaps_or_overlaps": len(report.chain_errors), "summary": report.summary()}


def _kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"unknown fault kind(s) {unknown or text!r}; choose from {','.join(KINDS)}")
    return kinds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="example: python launch/bench/chaos_soak.py --faults 100 --nodes 3")
    parser.add_argument("--faults", type=int, default=100)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--wan", default=None, help="run over an emulated WAN profile (root; adds partitions)")
    parser.add_argument("--hang-s", type=float, default=120.0, help="no commit this long after a fault = a hang")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every-kind-in-turn", action="store_true",
                        help="inject the kinds in a fixed rotation instead of at random (the smoke test does)")
    parser.add_argument("--kinds", type=_kinds, default=None, metavar="KIND,KIND",
                        help=f"only these kinds of fault (default: all of {','.join(KINDS)})")
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--out", default=None, help="also write the result as JSON here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the cluster, remove the namespaces
    result = soak(args)
    print(f"\nchaos soak: {result['faults']} faults over {result['minutes']} min, {args.nodes} nodes, WAN {result['wan']}")
    print(f"{'fault':<22}{'injected':>9}{'survived':>9}{'longest s':>11}")
    for kind, row in result["by_kind"].items():
        print(f"{kind:<22}{row['injected']:>9}{row['survived']:>9}{row['longest_s']:>11}")
    for why in result["failed"]:
        print(f"  not survived: {why}")
    print(f"survived {result['survived']} of {result['faults']}; hangs {result['hangs']}; harness could not inject "
          f"{result['not_injected']}; nodes crashed on their own "
          f"{result['crashed']}; outer steps committed {result['outer_steps_committed']}; replicas diverged at "
          f"{result['diverged_steps']} outer steps ({result['diverged_events']} divergence events); longest fault → "
          f"next commit {result['longest_fault_to_commit_s']} s (median {result['median_fault_to_commit_s']} s)")
    print(f"back to all {args.nodes} nodes in sync before the next fault: longest wait "
          f"{result['longest_back_to_full_strength_s']} s; not within {args.hang_s:.0f} s: {result['slow_recoveries']}")
    spent = result["seconds_by_phase"]
    print("wall-clock by phase (s): " + ", ".join(f"{k} {v}" for k, v in spent.items() if v >= 0.1))
    data = result["data"]
    print(f"data: {data['documents']} document passes ({data['tokens']} tokens) in {data['ranges']} committed ranges; "
          f"duplicated {data['duplicated']}, lost (gaps or incomplete documents) "
          f"{data['gaps_or_overlaps'] + data['incomplete']}")
    if not data["ok"]:
        print(data["summary"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    ok = result["hangs"] == 0 and not result["failed"] and result["diverged_steps"] == 0 and result["crashed"] == 0 and \
        result["slow_recoveries"] == 0 and result["data"]["ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
