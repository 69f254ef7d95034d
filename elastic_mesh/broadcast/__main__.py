"""Broadcast command line: publish a version, fetch one, or relay every version as it comes.

    python -m elastic_mesh.broadcast publish --token T --kind policy --version 3 ckpt/     (serves until Ctrl-C)
    python -m elastic_mesh.broadcast fetch --token T --kind policy --out policy/           (newest version)
    python -m elastic_mesh.broadcast relay --token T --kind policy --work-dir relay/      (follows for ever)

Every member serves what it has verified to the others, so each added client adds upload capacity.
Tokens come from `python -m elastic_mesh.coordinator token create` (a publisher's with --publish).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from tqdm import tqdm

from elastic_mesh.broadcast.member import (
    BroadcastError,
    BroadcastMember,
    BroadcastSettings,
)
from elastic_mesh.broadcast.payload import files_as_tensors, write_files
from elastic_mesh.cli import CommandLine, Commands, Flag, Positional
from elastic_mesh.control.token import TokenError

log = logging.getLogger("elastic_mesh.broadcast")


PROG = "python -m elastic_mesh.broadcast"
_COMMON = [
    Flag("token", "a join token of the run (worker or node role)", required=True, metavar="TOKEN"),
    Flag("kind", "what is broadcast, e.g. policy", default="policy", metavar="KIND"),
    Flag("report", "write what happened here as JSON", type=Path, metavar="FILE"),
    Flag("verbose", "log every chunk (where from, how long)", switch=True),
]
_ORIGIN_ONLY = Flag("origin-only", "fetch from publishers only (a fixed tree's first level; measurements only)",
                    switch=True)
COMMANDS = Commands(PROG, __doc__.split("\n\n")[0], {
    "publish": CommandLine(
        f"{PROG} publish", "Publish files as a new version and serve them.", BroadcastSettings,
        [*_COMMON,
         Flag("version", "version number; must exceed every earlier one", required=True, type=int, metavar="N"),
         Flag("serve-s", "stop serving after this many seconds (default: until Ctrl-C, or --until-copies)",
              type=float, metavar="SECONDS"),
         Flag("until-copies", "stop once this many other members hold a complete verified copy", type=int,
              metavar="N")],
        positionals=[Positional("paths", "files or folders (a folder: every file under it)", many=True, type=Path)],
        examples=[f"{PROG} publish --token T --kind policy --version 3 ckpt/"]),
    "fetch": CommandLine(
        f"{PROG} fetch", "Fetch a version (default the newest), verified, and write its files.", BroadcastSettings,
        [*_COMMON,
         Flag("version", "default: the newest", type=int, metavar="N"),
         Flag("out", "write the version's files here", type=Path, metavar="DIR"),
         Flag("work-dir", "verified chunks (a restarted fetch resumes from them)", type=Path,
              default=Path(".broadcast"), metavar="DIR"),
         Flag("wait-s", "wait this long for a version to be published (0: fail at once if none)", type=float,
              default=0.0, metavar="SECONDS"),
         Flag("serve-s", "keep serving this long after the fetch", type=float, default=0.0, metavar="SECONDS"),
         Flag("no-serve", "fetch without relaying (measurements only)", switch=True),
         _ORIGIN_ONLY,
         Flag("from", "comma-separated host:port: fetch from these only (measurements of fixed trees)",
              metavar="SOURCES")],
        examples=[f"{PROG} fetch --token T --kind policy --out policy/"]),
    "relay": CommandLine(
        f"{PROG} relay", "Fetch every new version as it is published and serve it.", BroadcastSettings,
        [*_COMMON,
         Flag("work-dir", "verified chunks of the versions kept", type=Path, default=Path(".broadcast-relay"),
              metavar="DIR"),
         _ORIGIN_ONLY],
        examples=[f"{PROG} relay --token T --kind policy --work-dir relay/ --keep 2"]),
})


def _progress_bar(kind: str):
    bar: list[tqdm] = []

    def update(done: int, total: int) -> None:
        if not bar:
            bar.append(tqdm(total=total, initial=done - 1, unit="chunk", desc=f"fetch {kind}", leave=True))
        bar[0].update(1)
    return update, bar


def main(argv: list[str] | None = None) -> int:
    words, parsed = COMMANDS.parse(argv)
    args = SimpleNamespace(command=words[0], **parsed.flags, **parsed.positionals)
    settings = parsed.config
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s.%(msecs)03d [broadcast] %(message)s", datefmt="%H:%M:%S")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    work = getattr(args, "work_dir", None) or Path(".broadcast-publish")
    progress, bar = _progress_bar(args.kind) if args.command == "fetch" else (None, [])
    member = None
    try:
        member = BroadcastMember(args.token, args.kind, work, settings, serve=not getattr(args, "no_serve", False),
                                 on_progress=progress)
        result = {"command": args.command, "kind": args.kind}
        if args.command == "publish":
            tensors, meta = files_as_tensors(args.paths)
            manifest = member.publish(args.version, tensors, meta)
            result.update(version=args.version, bytes=manifest["total_bytes"], root=manifest["root"],
                          published_at=time.time())
            if args.report:  # at once, so a watcher knows when the version went out
                args.report.write_text(json.dumps(result))
            _serve_publisher(member, args, stop)
        elif args.command == "fetch":
            only = _restriction(args)
            manifest = _wait_manifest(member, args.version, args.wait_s)
            target, report = member.fetch(manifest=manifest, only=only)
            for b in bar:
                b.close()
            log.info("%s %d fetched and verified: %.1f MB in %.2f s from %d source(s)%s", args.kind, target.version,
                     report.total_bytes / 1e6, report.seconds, len(report.bytes_from),
                     f"; bad chunks from {', '.join(report.corrupt)}" if report.corrupt else "")
            result.update(version=target.version, bytes=report.total_bytes, seconds=report.seconds,
                          finished_at=time.time(), bytes_from=report.bytes_from, corrupt=report.corrupt,
                          failed=report.failed, resumed_chunks=report.resumed_chunks, root=manifest["root"])
            if args.out:
                files = write_files(target, args.out)
                log.info("wrote %d file(s) under %s", len(files), args.out)
            if args.report:  # written before serving on, so a watcher sees it at once
                args.report.write_text(json.dumps({**result, "served_bytes": member.served_bytes()}))
            stop.wait(args.serve_s)
        else:
            threading.Thread(target=lambda: (stop.wait(), member.stop()), daemon=True).start()
            member.follow(lambda target, report: log.info(
                "%s %d relayed: %.1f MB verified in %.2f s; serving it", args.kind, target.version,
                report.total_bytes / 1e6, report.seconds), only=_restriction(args))
        result["served_bytes"] = member.served_bytes()
        if args.report:
            args.report.write_text(json.dumps(result))
        return 0
    except (BroadcastError, TokenError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if member is not None:
            member.stop()


def _restriction(args):
    if getattr(args, "origin_only", False):
        return lambda h: h["origin"]
    if getattr(args, "from", None):
        allowed = set(getattr(args, "from").split(","))
        return lambda h: h["address"] in allowed
    return None


def _wait_manifest(member: BroadcastMember, version: int | None, wait_s: float) -> dict:
    if version is not None or wait_s <= 0:
        return member.manifest(version)
    log.info("waiting up to %.0f s for a %s version to be published", wait_s, member.kind)
    found = member.wait_newer(-1, timeout_s=wait_s)
    if found is None:
        raise BroadcastError(f"no {member.kind} version was published within {wait_s:.0f} s")
    return found


def _serve_publisher(member: BroadcastMember, args, stop: threading.Event) -> None:
    deadline = time.monotonic() + args.serve_s if args.serve_s is not None else None
    log.info("serving %s %d on port %d%s", args.kind, args.version, member.server.port,
             f" until {args.until_copies} others hold it" if args.until_copies else "")
    while not stop.wait(0.5):
        if deadline is not None and time.monotonic() > deadline:
            return
        if args.until_copies and member.complete_copies(args.version) >= args.until_copies:
            log.info("%d other members hold a complete copy; the origin stops serving", args.until_copies)
            return


if __name__ == "__main__":
    sys.exit(main())
