"""Benchmark: a stream of small versions (an RL policy every half second) from one publisher to N
followers over the WAN emulator: how long from the start of a publish until each follower holds the
version verified. This is the path every asynchronous RL step waits on (launch/bench/rl_async.py),
measured without the training around it, so a change to the broadcast can be judged in a minute.

Every host (coordinator, publisher, N followers) is its own network namespace behind an access link of
--mbit up and down and --latency-ms one way (netem where the kernel has it, else the user-space TUN
emulator; the output says which). Two modes, one after the other on fresh hosts, same payloads:

- swarm:  every follower fetches from everyone who holds chunks and serves what it verified (ours).
- origin: every follower fetches from the publisher only and serves nothing.
- requests (with --modes): the swarm without streams (BroadcastSettings.stream off: a request per chunk,
  a standing request answered with one chunk), the broadcast as it was before streams.

Reported per mode: publish → held, median and 90th percentile over every follower and version (the first
two versions left out: connections are being opened), versions a follower skipped (it fell behind), and
the lower bound max(P/U, N·P/((N+1)·U)) + one one-way path (P payload, U uplink). Last line:

    version_stream: N=<n> <mb> MB every <s> s: swarm median <s> s (p90 <s>), origin-only median <s> s, ratio <x>, bound <s> s

    sudo python launch/bench/version_stream.py [--followers 3] [--payload-mb 1.2] [--every-s 0.5] [--versions 30]
                                               [--mbit 50] [--latency-ms 10]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from elastic_mesh.broadcast.member import BroadcastSettings
from elastic_mesh.control.process_tree import kill_tree
from elastic_mesh.coordinator.run import make_token
from launch.cluster import REPO, wait_for
from launch.wan.harness import LinkProfile, WanTopology
from prime.rl.transport.policy_files import policy_broadcast_settings, policy_chunk_bytes

POLICY = policy_broadcast_settings(keep=2, advertise_host=None)

SKIP_FIRST = 2  # versions whose fetch opens the connections


def run_mode(mode: str, args, root: Path) -> dict:
    followers = [f"follower{i}" for i in range(args.followers)]
    link = LinkProfile(latency_ms=args.latency_ms, up_mbit=args.mbit, down_mbit=args.mbit)
    work = root / mode
    work.mkdir(parents=True)
    procs: list[subprocess.Popen] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}

    def start(wan: WanTopology, host: str, cmd: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(wan.exec_prefix(host) + cmd, cwd=REPO, env=env, stdout=open(work / f"{host}.log", "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        return proc

    with WanTopology(["coordinator", "publisher", *followers], link) as wan:
        try:
            state = work / "coord"
            address = f"{wan.address('coordinator')}:29400"
            start(wan, "coordinator", [sys.executable, "-m", "elastic_mesh.coordinator", "serve", "--host",
                                       wan.address("coordinator"), "--port", "29400", "--state-dir", str(state),
                                       "--advertise", address])
            wait_for(lambda: (state / "address").exists(), 60, "the coordinator")
            publisher = make_token(state, 3600, role="node", publish=True)
            member = [sys.executable, str(REPO / "launch" / "bench" / "version_stream_member.py")]
            common = ["--chunk-mb", str(args.chunk_mb), "--follow-overlap", str(args.follow_overlap),
                      "--payload-mb", str(args.payload_mb),
                      "--upload-slots", str(args.upload_slots), "--streams-per-source", str(args.streams_per_source),
                      *(["--verbose"] if args.verbose else [])]
            for f in followers:
                token = make_token(state, 3600, role="worker")
                start(wan, f, member + ["follow", "--token", token, "--work-dir", str(work / f), "--out",
                                        str(work / f"{f}.jsonl"), *common, *(["--origin-only"] if mode == "origin" else []),
                                        *(["--no-stream"] if mode == "requests" else [])])
            pub = start(wan, "publisher", member + ["publish", "--token", publisher, "--work-dir", str(work / "publisher"),
                                                    "--out", str(work / "published.jsonl"), "--versions",
                                                    str(args.versions), "--every-s", str(args.every_s), *common])
            pub.wait(timeout=args.versions * args.every_s + 120)
            backend = wan.backend
        finally:
            for proc in procs:
                if proc.poll() is None:
                    kill_tree(proc.pid)
                    proc.wait()
    began = {r["version"]: r["began"] for r in _lines(work / "published.jsonl")}
    delays, skipped = [], 0
    for f in followers:
        held = {r["version"]: r["held"] for r in _lines(work / f"{f}.jsonl")}
        counted = [v for v in began if v >= SKIP_FIRST]
        skipped += sum(v not in held for v in counted)
        delays += [held[v] - began[v] for v in counted if v in held]
    if not delays:
        raise SystemExit(f"{mode}: no follower held any version; logs in {work}")
    delays.sort()
    return {"mode": mode, "backend": backend, "median": statistics.median(delays),
            "p90": delays[min(len(delays) - 1, int(0.9 * len(delays)))], "skipped": skipped, "samples": len(delays)}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="example: sudo python launch/bench/version_stream.py --followers 3")
    parser.add_argument("--followers", type=int, default=3, help="followers (default 3: an orchestrator and 2 workers)")
    parser.add_argument("--payload-mb", type=float, default=1.2, help="a version's size (default 1.2: the digit policy)")
    parser.add_argument("--chunk-mb", type=float, default=None, help="chunk size, MiB (default: what an RL policy of "
                        "--payload-mb travels in, prime.rl.transport.policy_files: 1/32 for 1.2 MB)")
    parser.add_argument("--follow-overlap", type=int, default=POLICY.follow_overlap,
                        help=f"versions a follower downloads at once (default {POLICY.follow_overlap}, as RL policies)")
    defaults = BroadcastSettings()
    parser.add_argument("--upload-slots", type=int, default=defaults.upload_slots,
                        help=f"chunks each member sends at once (default {defaults.upload_slots}, the setting's)")
    parser.add_argument("--streams-per-source", type=int, default=defaults.streams_per_source,
                        help=f"chunks a member asks of one source at once (default {defaults.streams_per_source})")
    parser.add_argument("--every-s", type=float, default=0.5, help="a new version this often (default 0.5)")
    parser.add_argument("--versions", type=int, default=30)
    parser.add_argument("--mbit", type=float, default=50, help="every host's uplink and downlink (default 50)")
    parser.add_argument("--latency-ms", type=float, default=10, help="one way, per access link (default 10)")
    parser.add_argument("--modes", default="swarm,origin", help="comma-separated: swarm, origin, requests "
                        "(default swarm,origin)")
    parser.add_argument("--verbose", action="store_true", help="every member logs every chunk (with --keep)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the logs under this folder")
    args = parser.parse_args()
    if args.chunk_mb is None:
        args.chunk_mb = policy_chunk_bytes(int(args.payload_mb * 1e6)) / (1 << 20)
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench-version-stream-"))
    results = {}
    for mode in [m for m in args.modes.split(",") if m]:
        r = results[mode] = run_mode(mode, args, root)
        print(f"{mode:>6}: publish -> held median {r['median']:.3f} s, p90 {r['p90']:.3f} s over {r['samples']} "
              f"(version, follower) pairs, {r['skipped']} skipped ({r['backend']} backend)", flush=True)
    payload, up = args.payload_mb * 1e6, args.mbit * 1e6 / 8
    n = args.followers
    bound = max(payload / up, n * payload / ((n + 1) * up)) + 2 * args.latency_ms / 1e3
    if "swarm" in results and "origin" in results:
        s, o = results["swarm"], results["origin"]
        print(f"version_stream: N={n} {args.payload_mb:g} MB every {args.every_s:g} s: swarm median {s['median']:.3f} s "
              f"(p90 {s['p90']:.3f}), origin-only median {o['median']:.3f} s, ratio {s['median'] / o['median']:.2f}, "
              f"bound {bound:.3f} s")
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
