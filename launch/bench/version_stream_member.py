"""One host of launch/bench/version_stream.py: the publisher of a stream of versions, or a follower.

    python launch/bench/version_stream_member.py publish --token T --versions 30 --every-s 0.5 --payload-mb 1.2 --out P.jsonl
    python launch/bench/version_stream_member.py follow --token T --out F.jsonl [--origin-only]

Each line of --out is one version: the publisher's when it began publishing and when the coordinator
had signed it, a follower's when it held the version verified (wall clock: the namespaces share it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import torch

from elastic_mesh.broadcast.member import BroadcastMember, BroadcastSettings

KIND = "stream"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=["publish", "follow"])
    parser.add_argument("--token", required=True)
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--versions", type=int, default=30)
    parser.add_argument("--every-s", type=float, default=0.5)
    parser.add_argument("--payload-mb", type=float, default=1.2)
    parser.add_argument("--chunk-mb", type=float, default=0.125)
    parser.add_argument("--upload-slots", type=int, default=BroadcastSettings().upload_slots)
    parser.add_argument("--streams-per-source", type=int, default=BroadcastSettings().streams_per_source)
    parser.add_argument("--follow-overlap", type=int, default=1, help="versions a follower downloads at once")
    parser.add_argument("--origin-only", action="store_true", help="fetch from the publisher only, serve nothing")
    parser.add_argument("--no-stream", action="store_true", help="a request per chunk (BroadcastSettings.stream off)")
    parser.add_argument("--verbose", action="store_true", help="log every chunk: where from, how long")
    args = parser.parse_args()
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s.%(msecs)03d %(name)s %(message)s", datefmt="%H:%M:%S")
    settings = BroadcastSettings(keep=2, chunk_mb=args.chunk_mb, upload_slots=args.upload_slots,
                                 streams_per_source=args.streams_per_source, stream=not args.no_stream,
                                 follow_overlap=args.follow_overlap)
    member = BroadcastMember(args.token, KIND, args.work_dir, settings, serve=not args.origin_only)
    out = args.out.open("a")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        if args.role == "publish":
            stop.wait(1.0)  # the followers' first long-polls are in
            for version in range(args.versions):
                payload = torch.frombuffer(bytearray(os.urandom(int(args.payload_mb * 1e6))), dtype=torch.uint8)
                began = time.time()
                member.publish(version, {"weights": payload})
                out.write(json.dumps({"version": version, "began": began, "signed": time.time()}) + "\n")
                out.flush()
                if stop.wait(max(0.0, began + args.every_s - time.time())):
                    break
            stop.wait(3.0)  # serve the last one to whoever is still fetching it
        else:
            def held(target, report) -> None:
                out.write(json.dumps({"version": target.version, "held": time.time(), "seconds": report.seconds,
                                      "bytes_from": report.bytes_from}) + "\n")
                out.flush()

            threading.Thread(target=lambda: (stop.wait(), member.stop()), daemon=True).start()
            member.follow(held, only=(lambda h: h["origin"]) if args.origin_only else None)
    finally:
        member.stop()
        out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
