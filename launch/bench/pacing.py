"""Benchmark: how evenly a paced all-reduce (diloco.pace) loads an emulated link, with and without loss.

Two hosts behind the same access link (default 5 Mbit/s, 40 ms ± 4 ms one way), one paced int8
all-reduce of a cpu-demo-sized pseudo-gradient fragment (1.48M values) spread over --spread seconds,
once per loss rate, paced by the token bucket alone and with the kernel pacing the group's sockets
too (elastic_mesh/wire/socket_pacing.py). Prints the transfer's average rate and the peak rate any host's
link delivered in any 1 s and 2 s of it (sampled every 0.25 s from /proc/<pid>/net/dev): a perfect
pacer reads about 1.05× (the TCP/IP headers on the wire, which the payload average leaves out).

    python launch/bench/pacing.py [--spread 10] [--losses 0,0.001] [--mbit 5] [--pacers bucket,kernel]
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def member(rank: int, address: str, port: int, spread: float, values: int, kernel: bool) -> None:
    import torch
    import torch.distributed as dist

    from elastic_mesh.wire.codecs import codec_for
    from elastic_mesh.wire.collectives import all_reduce_mean
    from elastic_mesh.wire.socket_pacing import NewConnections

    torch.set_num_threads(1)
    store = dist.TCPStore(address, port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    watch = NewConnections()
    pg = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=120))
    sockets = watch.since(peers=1)
    if kernel and sockets is None:
        raise SystemExit("the group's sockets were not found, so the kernel cannot pace them")
    all_reduce_mean(pg, torch.randn(1000), codec_for("int8"), [True, True])  # connections up first
    time.sleep(1)
    started = time.time()
    result = all_reduce_mean(pg, torch.randn(values), codec_for("int8"), [True, True], spread_s=spread,
                             sockets=[sockets] if kernel else None)
    print("RESULT", started, time.time(), result.bytes_sent, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n")[-1])
    parser.add_argument("--spread", type=float, default=10.0, help="seconds the all-reduce is spread over")
    parser.add_argument("--losses", default="0,0.001", help="packet loss rates to compare, comma-separated")
    parser.add_argument("--mbit", type=float, default=5.0, help="access link rate, Mbit/s")
    parser.add_argument("--values", type=int, default=1_480_000, help="fp32 values all-reduced")
    parser.add_argument("--pacers", default="bucket,kernel",
                        help="bucket: the token bucket alone; kernel: the bucket and the kernel (SO_MAX_PACING_RATE)")
    parser.add_argument("--member", nargs=4, metavar=("RANK", "ADDRESS", "PORT", "PACER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.member:
        member(int(args.member[0]), args.member[1], int(args.member[2]), args.spread, args.values,
               args.member[3] == "kernel")
        return 0
    from launch.wan.harness import LinkProfile, WanTopology, WireMeter

    env = {**os.environ, "GLOO_SOCKET_IFNAME": "wan0", "OMP_NUM_THREADS": "1"}
    runs = [(float(loss), pacer) for loss in args.losses.split(",") for pacer in args.pacers.split(",")]
    if any(pacer not in ("bucket", "kernel") for _, pacer in runs):
        parser.error(f"--pacers takes bucket and/or kernel, got {args.pacers!r}")
    for loss, pacer in runs:
        profile = LinkProfile(latency_ms=40, jitter_ms=4, loss=loss, up_mbit=args.mbit, down_mbit=args.mbit)
        with WanTopology(["a", "b"], profile) as wan:
            procs = [subprocess.Popen([*wan.exec_prefix(host), sys.executable, __file__, "--spread", str(args.spread),
                                       "--values", str(args.values), "--member", str(rank), wan.address("a"), "29611", pacer],
                                      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                     for rank, host in enumerate(["a", "b"])]
            with WireMeter({host: p.pid for host, p in zip(["a", "b"], procs)}) as meter:
                outputs = [p.communicate(timeout=args.spread * 4 + 120)[0] for p in procs]
            results = [line.split() for out in outputs for line in out.splitlines() if line.startswith("RESULT")]
            if len(results) != 2:
                raise SystemExit(f"a member failed at loss {loss}: {outputs}")
            start, end = min(float(r[1]) for r in results), max(float(r[2]) for r in results)
            average = int(results[0][3]) / (end - start)
            peaks = [meter.peak_bytes_per_s(w, start, end) for w in (1.0, 2.0)]
            print(f"backend {wan.backend}, {args.mbit:g} Mbit/s, loss {loss:g}, {pacer:6}: {int(results[0][3]) / 1e6:.2f} MB in "
                  f"{end - start:.2f} s (asked {args.spread:g} s), average {average * 8 / 1e6:.2f} Mbit/s, peak 1 s "
                  f"{peaks[0] * 8 / 1e6:.2f} ({peaks[0] / average:.2f}x), peak 2 s {peaks[1] * 8 / 1e6:.2f} "
                  f"({peaks[1] / average:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
