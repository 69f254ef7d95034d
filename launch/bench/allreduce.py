"""Benchmark: prime's int8 all-reduce against Gloo's own fp32 all_reduce, side by side, over an emulated WAN.

N members, each in its own network namespace behind a rate-limited link (launch/wan/harness.py), all-reduce
the same fp32 tensor with both, alternating, and print the speed-up, each one's effective throughput
(bytes a member must upload / time, against the link rate) and the int8 error. --streams compares
int8 over 1, 2, 4 ... TCP connections per peer pair (mesh.streams_per_peer) in the same run.

    python launch/bench/allreduce.py [--nodes 3] [--mb 100] [--mbit 30] [--latency-ms 10] [--repeats 2]
    python launch/bench/allreduce.py --nodes 3 --mb 20 --mbit 5 --latency-ms 40 --loss 0.1 --streams 1,2,4 --no-fp32
    python launch/bench/allreduce.py --profile global --mb 25.6 --sparse --no-fp32   (int8 against sparse)

--sparse adds the sparse exchange (diloco.compression = sparse, its default settings: gathered whole,
encoding and decoding timed with it) and prints its time over int8's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

from elastic_mesh import SparseCodec
from launch.wan.harness import PROFILES, LinkProfile, WanTopology


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="example: python launch/bench/allreduce.py --nodes 3 --mb 100 --mbit 30")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--mb", type=float, default=100.0, help="fp32 megabytes per member")
    parser.add_argument("--mbit", type=float, default=30.0, help="upload and download rate of every member")
    parser.add_argument("--latency-ms", type=float, default=10.0, help="one-way latency of every access link")
    parser.add_argument("--loss", type=float, default=0.0, help="packet loss of every access link, percent")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--streams", default="1", help="TCP connections per peer pair for int8, comma-separated")
    parser.add_argument("--no-fp32", action="store_true", help="skip Gloo's fp32 all_reduce (slow links)")
    parser.add_argument("--sparse", action="store_true", help="also the sparse exchange, timed against int8")
    parser.add_argument("--profile", choices=sorted(PROFILES), default=None,
                        help="a WAN profile of launch/wan/harness.py instead of --mbit/--latency-ms/--loss")
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    profile = LinkProfile(latency_ms=args.latency_ms, jitter_ms=0, loss=args.loss / 100, up_mbit=args.mbit,
                          down_mbit=args.mbit)
    if args.profile:
        profile = PROFILES[args.profile]
        args.mbit, args.latency_ms, args.loss = profile.up_mbit, profile.latency_ms, profile.loss * 100
    hosts = [f"m{i}" for i in range(args.nodes)]
    with WanTopology(hosts, profile) as wan:
        print(wan.describe(), flush=True)
        master = f"{wan.address('m0')}:29555"
        procs = [subprocess.Popen(wan.exec_prefix(h) + [sys.executable, str(REPO / "launch/bench/allreduce_worker.py"),
                                                        str(i), str(args.nodes), master, str(args.mb),
                                                        str(args.repeats), wan.interface(),
                                                        json.dumps({"streams": streams, "fp32": not args.no_fp32,
                                                                    "sparse": SparseCodec().name if args.sparse else ""})],
                                  stdout=subprocess.PIPE, text=True) for i, h in enumerate(hosts)]
        out = procs[0].communicate(timeout=3600)[0]
        for p in procs[1:]:
            p.wait(timeout=600)
    results = json.loads(out.strip().splitlines()[-1])
    n, size = args.nodes, args.mb * 1e6
    link = args.mbit * 1e6 / 8
    fp32_need = 2 * (n - 1) / n * size  # a ring all-reduce uploads this much per member
    int8_need = results["int8_bytes_sent"]
    print(f"{n} members, {args.mb:g} MB fp32 each, {args.mbit:g} Mbit/s links, {2 * 2 * args.latency_ms:g} ms RTT, "
          f"{args.loss:g}% loss per access link (backend {wan.backend}), median of {args.repeats}")
    int8 = {s: statistics.median(results[f"prime_int8_fixed_x{s}"]) for s in streams}
    if not args.no_fp32:
        fp32_s = statistics.median(results["gloo_fp32"])
        print(f"Gloo fp32 all_reduce: {fp32_s:.2f} s, effective {fp32_need / fp32_s / link:.2f} of link rate")
    for s, seconds in int8.items():
        print(f"prime int8 all-reduce, {s} stream(s) per peer pair: {seconds:.2f} s, effective "
              f"{int8_need / seconds / link:.2f} of link rate" + (f", {int8[streams[0]] / seconds:.2f}x the first"
                                                                  if s != streams[0] else ""))
    print(f"{int8_need / 1e6:.1f} MB uploaded per member, error {results['int8_error'] * 100:.2f}%")
    print(f"int8 phase end times (s since start): {results.get('phases')}")
    if args.sparse:
        sparse_s = statistics.median(results["prime_sparse_fixed_x1"])
        print(f"prime sparse exchange ({SparseCodec().name}): {sparse_s:.2f} s, "
              f"{results['sparse_bytes_sent'] / 1e6:.3f} MB uploaded per member, cosine to the exact mean "
              f"{results['sparse_cosine']:.3f}")
        print(f"sparse exchange / int8 all-reduce: {sparse_s / int8[streams[0]]:.3f}x the time")
    if not args.no_fp32:
        print(f"speed-up int8 ({streams[0]} stream(s)) / fp32: {fp32_s / int8[streams[0]]:.2f}x "
              f"(wire bytes {fp32_need / int8_need:.2f}x fewer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
