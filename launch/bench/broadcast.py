"""Benchmark: one origin sends a version to N clients over the WAN emulator: from the origin alone, through
a fixed relay tree, through our swarm, and through shardcast 0.3.2 (the public anchor) on the same links.

Every host (coordinator, origin, R tree relays, N clients) is its own network namespace behind an
access link of --up-mbit up and --down-mbit down and --latency-ms one way; every uplink is as slow as
the origin's. Each mode starts afresh. The clients are started and waiting before the version is
published; the time is from publication until the last client holds a verified copy.

- origin: every client fetches from the origin only and relays nothing.
- tree:   R relay members fetch from the origin only; each client from the relays only (SHARDCAST's shape).
- swarm:  every client fetches from everyone who holds chunks and serves what it verified (ours).
- shardcast (--anchor shardcast): shardcast's origin server, R middle nodes, N client nodes, its defaults
  (50 MB shards, 30 s checks; clients retry every 30 s, as prime-rl's do). Each of its processes gets
  its own copy of the package (it writes scratch files beside it) and the hosts start one at a time
  (it probes every server through one fixed /tmp file); clients still stuck after --anchor-timeout-s
  are reported as such.

Lower bounds, with U the uplink and D the downlink in bytes/s and P the payload: origin N·P/U; tree
max(R·P/U, ⌈N/R⌉·P/U, P/D); swarm max(P/U, N·P/((N+1)·U), P/D). Last line:
    broadcast: N=8 swarm <s> s, origin-only <s> s, speedup <x>, swarm/lower-bound <y>, shardcast <s> s

    sudo python launch/bench/broadcast.py [--clients 8] [--payload-mb 64] [--up-mbit 16] [--down-mbit 64]
                                          [--latency-ms 10] [--relays 2] [--modes origin,tree,swarm]
                                          [--anchor shardcast]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elastic_mesh.control.process_tree import kill_tree
from elastic_mesh.coordinator.run import make_token
from launch.cluster import REPO, wait_for
from launch.wan.harness import LinkProfile, WanTopology

PORT = 29500  # every member's chunk server (each host is its own namespace)


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def lower_bound(mode: str, n: int, relays: int, payload: float, up: float, down: float) -> float:
    if mode == "origin":
        return max(n * payload / up, payload / down)
    if mode in ("tree", "shardcast"):
        return max(relays * payload / up, math.ceil(n / relays) * payload / up, payload / down)
    return max(payload / up, n * payload / ((n + 1) * up), payload / down)


class Hosts:
    """One mode's topology and the processes running in it."""

    def __init__(self, wan: WanTopology, work: Path) -> None:
        self.wan, self.work, self.procs = wan, work, []

    def start(self, host: str, cmd: list[str], log: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        out = open(self.work / log, "w")
        proc = subprocess.Popen(self.wan.exec_prefix(host) + cmd, cwd=REPO, env={**_env(), **(env or {})}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()


def run_ours(mode: str, args, hosts: Hosts, clients: list[str], relays: list[str], payload: Path) -> dict:
    wan, work = hosts.wan, hosts.work
    state = work / "coord"
    coord = f"{wan.address('coordinator')}:29400"
    hosts.start("coordinator", [sys.executable, "-m", "elastic_mesh.coordinator", "serve", "--host",
                                wan.address("coordinator"), "--port", "29400", "--state-dir", str(state),
                                "--advertise", coord], "coordinator.log")
    wait_for(lambda: (state / "address").exists(), 60, "the coordinator")
    publisher = make_token(state, 3600, role="node", publish=True)
    worker = make_token(state, 3600, role="worker", max_nodes=len(clients) + len(relays))
    member = [sys.executable, "-m", "elastic_mesh.broadcast"]
    common = ["--token", worker, "--kind", "bench", "--port", str(PORT), "--chunk-mb", str(args.chunk_mb),
              "--timeout-s", "30", *args.member_arg]
    relay_sources = ",".join(f"{wan.address(r)}:{PORT}" for r in relays)
    waiting = []
    for r in relays if mode == "tree" else []:
        hosts.start(r, member + ["relay", *common, "--origin-only", "--work-dir", str(work / r)], f"{r}.log")
    for c in clients:
        extra = {"origin": ["--no-serve", "--origin-only"], "tree": ["--no-serve", "--from", relay_sources],
                 "swarm": []}[mode]
        hosts.start(c, member + ["fetch", *common, *extra, "--wait-s", "600", "--serve-s", "600",
                                 "--work-dir", str(work / c), "--report", str(work / f"{c}.json")], f"{c}.log")
        waiting.append(work / f"{c}.log")
    wait_for(lambda: all("waiting up to" in p.read_text() for p in waiting), 120, "every client waiting")
    hosts.start("origin", member + ["publish", "--token", publisher, "--kind", "bench", "--version", "1",
                                    "--port", str(PORT), "--chunk-mb", str(args.chunk_mb), "--report",
                                    str(work / "origin.json"), str(payload)], "origin.log")
    wait_for(lambda: (work / "origin.json").exists(), 300, "the publication")
    published = json.loads((work / "origin.json").read_text())["published_at"]
    reports = wait_for(lambda: all((work / f"{c}.json").exists() for c in clients) and
                       [json.loads((work / f"{c}.json").read_text()) for c in clients], args.timeout_s,
                       f"every client's verified copy ({mode})", every_s=0.1)
    origin_address = f"{wan.address('origin')}:{PORT}"
    from_origin = sum(r["bytes_from"].get(origin_address, 0) for r in reports)
    corrupt = sum(len(r["corrupt"]) for r in reports)
    return {"seconds": max(r["finished_at"] for r in reports) - published, "origin_copies": from_origin / reports[0]["bytes"],
            "corrupt": corrupt, "first": min(r["finished_at"] for r in reports) - published}


def run_shardcast(args, hosts: Hosts, clients: list[str], relays: list[str], payload: Path) -> dict:
    wan, work = hosts.wan, hosts.work
    anchor = [sys.executable, str(REPO / "launch/bench/shardcast_anchor.py")]
    origin_url = f"http://{wan.address('origin')}:8000"
    go = work / "go"

    def own_copy(host: str) -> dict[str, str]:
        # Shardcast writes its scratch files next to its own package (temp_distribution.txt) and to
        # /tmp/dummy.bin: fine with one process a machine, a race between our emulated hosts. Each gets
        # its own copy of the package; the /tmp/dummy.bin probes run one host at a time (below).
        import shardcast

        copy = work / host / "pkg"
        shutil.copytree(Path(shardcast.__file__).parent, copy / "shardcast", dirs_exist_ok=True)
        return {"PYTHONPATH": f"{copy}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    hosts.start("origin", anchor + ["origin", "--data-dir", str(work / "origin"), "--file", str(payload),
                                    "--report", str(work / "origin.json"), "--go", str(go)], "origin.log",
                own_copy("origin"))
    wait_for(lambda: "serving" in (work / "origin.log").read_text(), 60, "shardcast's origin")
    for r in relays:
        hosts.start(r, anchor + ["middle", "--data-dir", str(work / r), "--upstream", origin_url], f"{r}.log",
                    own_copy(r))
        wait_for(lambda: "Initialized server metrics" in (work / f"{r}.log").read_text(), 60, f"middle node {r}")
    servers = ",".join(f"http://{wan.address(r)}:8000" for r in relays)
    for c in clients:
        hosts.start(c, anchor + ["client", "--servers", servers, "--data-dir", str(work / c), "--out",
                                 str(work / c / "out.bin"), "--report", str(work / f"{c}.json")], f"{c}.log",
                    own_copy(c))
        wait_for(lambda: "client ready" in (work / f"{c}.log").read_text(), 60, f"shardcast client {c}")
    wait_for(lambda: all("client ready" in (work / f"{c}.log").read_text() for c in clients), 120,
             "shardcast's clients up")
    go.touch()  # everyone is up and polling: publish now
    wait_for(lambda: (work / "origin.json").exists(), 300, "shardcast's publication")
    published = json.loads((work / "origin.json").read_text())["published_at"]
    # Some of its clients can fall into its "count unknown" discovery (their second read of the
    # distribution file failed) and retry for many minutes: give up at --anchor-timeout-s and say how many.
    deadline = time.monotonic() + args.anchor_timeout_s
    while time.monotonic() < deadline and not all((work / f"{c}.json").exists() for c in clients):
        time.sleep(0.5)
    done = [json.loads((work / f"{c}.json").read_text())["finished_at"] - published
            for c in clients if (work / f"{c}.json").exists()]
    if len(done) < len(clients):
        return {"seconds": None, "done": sorted(done), "first": min(done, default=float("nan")),
                "gave_up": args.anchor_timeout_s}
    return {"seconds": max(done), "first": min(done), "done": sorted(done)}


def shardcast_missing() -> str | None:
    if importlib.util.find_spec("shardcast") is None:
        return "shardcast is not installed (pip install shardcast==0.3.2)"
    import shardcast

    if shardcast.__version__ != "0.3.2":
        return f"shardcast {shardcast.__version__} is installed, the anchor is 0.3.2"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="example: sudo python launch/bench/broadcast.py --payload-mb 16 --modes swarm")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--payload-mb", type=float, default=64)
    parser.add_argument("--up-mbit", type=float, default=16, help="every host's uplink (default 16)")
    parser.add_argument("--down-mbit", type=float, default=64, help="every host's downlink (default 64)")
    parser.add_argument("--latency-ms", type=float, default=10, help="one way, per access link (default 10)")
    parser.add_argument("--relays", type=int, default=2, help="relays of the fixed tree and of shardcast (default 2)")
    parser.add_argument("--chunk-mb", type=float, default=0.5, help="our chunk size, MiB (default 0.5)")
    parser.add_argument("--modes", default="origin,tree,swarm", help="comma-separated: origin, tree, swarm")
    parser.add_argument("--anchor", default=None, choices=["shardcast"], help="also run the anchor")
    parser.add_argument("--member-arg", action="append", default=[],
                        help="a setting for every member of our modes, e.g. --member-arg=--upload-slots=2")
    parser.add_argument("--anchor-timeout-s", type=float, default=600,
                        help="stop waiting for the anchor's last client after this long (default 600)")
    parser.add_argument("--timeout-s", type=float, default=1800, help="give up on a mode after this long")
    parser.add_argument("--keep", type=Path, default=None, help="keep every mode's logs under this folder")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if args.anchor:
        modes.append(args.anchor)
    n, up, down = args.clients, args.up_mbit * 1e6 / 8, args.down_mbit * 1e6 / 8
    link = LinkProfile(latency_ms=args.latency_ms, up_mbit=args.up_mbit, down_mbit=args.down_mbit)
    clients, relays = [f"client{i}" for i in range(n)], [f"relay{i}" for i in range(args.relays)]
    results: dict[str, dict] = {}
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench-broadcast-"))
    payload = root / "payload" / "weights.bin"
    payload.parent.mkdir(parents=True, exist_ok=True)
    with open(payload, "wb") as f:
        f.write(os.urandom(int(args.payload_mb * 1e6)))
    size = payload.stat().st_size
    for mode in modes:
        if mode == "shardcast" and (why := shardcast_missing()):
            print(f"shardcast: not run: {why}")
            continue
        work = root / mode
        work.mkdir(parents=True, exist_ok=True)
        with WanTopology(["coordinator", "origin", *relays, *clients], link) as wan:
            if mode == modes[0]:
                print(wan.describe().split(";")[0] + f"; every host {args.latency_ms:g} ms one way, "
                      f"{args.up_mbit:g} Mbit/s up, {args.down_mbit:g} Mbit/s down; payload {size / 1e6:.1f} MB; "
                      f"N={n}, {args.relays} relays", flush=True)
            hosts = Hosts(wan, work)
            try:
                if mode == "shardcast":
                    result = run_shardcast(args, hosts, clients, relays, payload)
                else:
                    result = run_ours(mode, args, hosts, clients, relays, payload)
            finally:
                hosts.stop()
        bound = lower_bound(mode, n, args.relays, size, up, down)
        results[mode] = result
        if result["seconds"] is None:
            result["text"] = f">{result['gave_up']:.0f} s ({len(result['done'])}/{n} clients)"
            print(f"{mode:>9}: {len(result['done'])} of {n} clients held a verified copy after {result['gave_up']:.0f} s "
                  f"(done at {', '.join(f'{t:.1f}' for t in result['done'])} s); lower bound {bound:.1f} s", flush=True)
            continue
        result.update(bound=bound, ratio=result["seconds"] / bound, text=f"{result['seconds']:.1f} s")
        # What reached the clients straight from the origin (in a tree, the relays took it).
        extra = (f", origin sent {result['origin_copies']:.2f} copies" if mode in ("origin", "swarm") else "")
        print(f"{mode:>9}: last client {result['seconds']:.1f} s (first {result['first']:.1f} s), lower bound "
              f"{bound:.1f} s, ratio {result['ratio']:.2f}{extra}", flush=True)
    if "swarm" in results and "origin" in results:
        swarm, origin = results["swarm"], results["origin"]
        anchor = results["shardcast"]["text"] if "shardcast" in results else "n/a"
        print(f"broadcast: N={n} swarm {swarm['seconds']:.1f} s, origin-only {origin['seconds']:.1f} s, speedup "
              f"{origin['seconds'] / swarm['seconds']:.2f}, swarm/lower-bound {swarm['ratio']:.2f}, shardcast {anchor}")
    print(f"logs: {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
