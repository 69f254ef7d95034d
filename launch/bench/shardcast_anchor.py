"""One role of the shardcast 0.3.2 anchor in launch/bench/broadcast.py (run inside a host's namespace).

    python launch/bench/shardcast_anchor.py origin --port 8000 --data-dir D --file F      (broadcasts, then serves)
    python launch/bench/shardcast_anchor.py middle --port 8000 --data-dir D --upstream http://IP:8000
    python launch/bench/shardcast_anchor.py client --servers http://IP:8000,... --out F --report R.json

Shardcast's own defaults throughout (50 MB shards, middle nodes checking upstream every 30 s); a client
tries to download version v1 and, as prime-rl's clients do, tries again every --poll-s (30 s) until
the middle nodes serve it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=["origin", "middle", "client"])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--data-dir", default="shardcast-data")
    parser.add_argument("--file", help="origin: the file to broadcast")
    parser.add_argument("--upstream", help="middle: the origin's URL")
    parser.add_argument("--servers", help="client: comma-separated URLs of the middle nodes")
    parser.add_argument("--out", help="client: where the reassembled file goes")
    parser.add_argument("--report", help="client/origin: JSON with the times")
    parser.add_argument("--go", help="origin: broadcast once this file exists (the others are up by then)")
    parser.add_argument("--poll-s", type=float, default=30.0, help="client: seconds between tries (default 30)")
    args = parser.parse_args()
    import shardcast

    # Shardcast's downloader measures each server by fetching `data1.bin` from it first and fails without
    # it (its client.py notes that making the file automatically is still to do): servers must have one.
    if args.role in ("origin", "middle"):
        os.makedirs(args.data_dir, exist_ok=True)
        with open(os.path.join(args.data_dir, "data1.bin"), "wb") as f:
            f.write(os.urandom(1 << 20))
    if args.role == "origin":
        origin = shardcast.OriginServer(args.data_dir, args.port)
        print("serving", flush=True)
        while args.go and not os.path.exists(args.go):
            time.sleep(0.05)
        started = time.time()
        origin.broadcast(args.file)
        if args.report:
            with open(args.report, "w") as f:
                json.dump({"started_at": started, "published_at": time.time()}, f)
        print("published", flush=True)
        while True:
            time.sleep(1)
    if args.role == "middle":
        shardcast.MiddleNode([args.upstream], args.data_dir, args.port)
        while True:
            time.sleep(1)
    while True:  # its downloader's set-up fails while a middle node is not up yet
        try:
            client = shardcast.ClientNode(args.servers.split(","), args.data_dir)
            break
        except Exception as e:
            print(f"client set-up: {e}; again in 1 s", flush=True)
            time.sleep(1)
    print("client ready", flush=True)
    while True:
        if client.download_version("v1", args.out):
            with open(args.report, "w") as f:
                json.dump({"finished_at": time.time()}, f)
            return 0
        time.sleep(args.poll_s)


if __name__ == "__main__":
    sys.exit(main())
