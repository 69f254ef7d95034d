"""Benchmark: what one coordinator request costs a node across an emulated WAN, side by side.

A real coordinator in its own namespace, one node behind the chosen profile (default `global`: two
hosts see ~160 ms RTT). The node joins, then sends the same heartbeats three ways, interleaved so
the machine's noise hits all alike:
- `urllib`: a new TCP connection per request, `Connection: close` (how the node's client worked
  before elastic_mesh/control/kept_connections.py);
- `new connection`: the client's own code with its kept connections closed before every request;
- `kept`: the client as nodes run it, one connection kept open between requests.
Each node asks the coordinator ready, vote and commit per outer step (plus rendezvous keys per new
epoch), so every round trip saved is saved several times per outer step.

    python launch/bench/coordinator_requests.py [--profile global] [--requests 30]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

from launch.cluster import LocalCluster, child_env
from launch.wan.harness import PROFILES, WanTopology


def node(address: str, token: str, requests: int) -> None:
    """Inside the node's namespace: prints the seconds of every request, per way, as JSON."""
    import statistics
    import time
    import urllib.request

    from elastic_mesh.control.client import CoordinatorClient

    client = CoordinatorClient(address, request_timeout_s=30, retry_s=10)
    client.join(token, name="probe", fingerprint="bench", procs_per_node=1, state_hash="h0", address="")
    headers = {"Content-Type": "application/json", "X-Prime-Node": client.credentials.node_id,
               "X-Prime-Session": client.credentials.session}
    body = json.dumps({"telemetry": []}).encode()

    def by_urllib() -> None:
        request = urllib.request.Request(f"http://{address}/v1/heartbeat", data=body, headers=headers)
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()

    def new_connection() -> None:
        client.close()
        client.post("/v1/heartbeat", {"telemetry": []})

    def kept() -> None:
        client.post("/v1/heartbeat", {"telemetry": []})

    ways = {"urllib": by_urllib, "new connection": new_connection, "kept": kept}
    for way in ways.values():  # warm up: the first request of a way is not counted
        way()
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(requests):
        for name, way in ways.items():
            started = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - started)
    print(json.dumps({name: {"median": statistics.median(t), "p90": sorted(t)[int(0.9 * (len(t) - 1))]}
                      for name, t in times.items()}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="example: python launch/bench/coordinator_requests.py --profile global")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="global")
    parser.add_argument("--requests", type=int, default=30, help="requests per way")
    parser.add_argument("--node", nargs=3, metavar=("ADDRESS", "TOKEN", "REQUESTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.node:
        node(args.node[0], args.node[1], int(args.node[2]))
        return 0
    with WanTopology(["coordinator", "node0"], args.profile) as wan, tempfile.TemporaryDirectory() as tmp:
        print(wan.describe(), flush=True)
        cluster = LocalCluster(Path(tmp), "configs/cpu-demo.toml", wan=wan)
        cluster.start_coordinator()
        try:
            address = f"{wan.address('coordinator')}:{cluster.port}"
            out = subprocess.run([*wan.exec_prefix("node0"), sys.executable, __file__, "--node", address,
                                  cluster.node_token("node0"), str(args.requests)], cwd=REPO, env=child_env(),
                                 capture_output=True, text=True, timeout=600)
            if out.returncode:
                print(out.stderr[-2000:], file=sys.stderr)
                return out.returncode
            result = json.loads(out.stdout.strip().splitlines()[-1])
        finally:
            cluster.kill_coordinator()
    kept = result["kept"]["median"]
    print(f"{args.requests} heartbeats per way, interleaved, profile {args.profile} (backend {wan.backend})")
    print(f"{'way':<16}{'median ms':>11}{'p90 ms':>9}{'vs kept':>9}")
    for name, t in result.items():
        print(f"{name:<16}{t['median'] * 1e3:>11.0f}{t['p90'] * 1e3:>9.0f}{t['median'] / kept:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
