"""Broadcast members that misbehave on purpose, each its own process, for tests/e2e/test_broadcast.py.

The faults go through the chunk server's fault seams (before_chunk, chunk_filter), never through the
production code path; the member itself is the real one.

    python -m tests.e2e.broadcast_faults liar --token T --work-dir D        (fetches, then serves corrupt bytes)
    python -m tests.e2e.broadcast_faults slow-origin --token T --file F --delay-s 0.1   (publishes, serves slowly)
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from elastic_mesh.broadcast.member import BroadcastMember, BroadcastSettings
from elastic_mesh.broadcast.payload import files_as_tensors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=["liar", "slow-origin"])
    parser.add_argument("--token", required=True)
    parser.add_argument("--work-dir", type=Path, default=Path("faulty"))
    parser.add_argument("--file", type=Path)
    parser.add_argument("--delay-s", type=float, default=0.1)
    parser.add_argument("--chunk-mb", type=float, default=0.25)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [faulty] %(message)s")
    member = BroadcastMember(args.token, "policy", args.work_dir,
                             BroadcastSettings(host="127.0.0.1", chunk_mb=args.chunk_mb))
    if args.role == "liar":
        member.fetch()
        # Its own download may still hold a standing stream to its own server (it did not know its address
        # until its first `have` was answered): lying before that stream ends would make it report, and
        # ban, itself before any client asks it (seen once under load).
        while not member.address:
            time.sleep(0.05)
        time.sleep(1.0)
        member.server.chunk_filter = lambda kind, version, index, data: bytes(b ^ 0xA5 for b in data[:32]) + data[32:]
    else:
        member.server.before_chunk = lambda kind, version, index: time.sleep(args.delay_s)
        tensors, meta = files_as_tensors([args.file])
        member.publish(1, tensors, meta)
    while not member.address:
        time.sleep(0.05)
    print(f"serving at {member.address}", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
