"""Benchmark: what TLS costs the control plane and snapshot transfers, plain and TLS side by side.

Everything runs on loopback in this process, so what is measured is the CPU that TLS adds (handshake,
encryption), not a network's round trips; both arms are interleaved so the machine's noise hits them
alike:
- control: a node's heartbeat to a coordinator on a kept connection (how nodes send ready, vote and
  commit), and on a new connection each time (a handshake per request: the worst case);
- snapshot: a joiner's download of `--mb` MiB from a peer's chunk server (recovery's 4 MiB chunks,
  2 streams), MiB/s.
Gloo's all-reduce is not part of it: torch's Gloo transport has no TLS, so its traffic is the same
either way (only the few control requests per outer step above change).

    python launch/bench/tls_cost.py [--requests 300] [--mb 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from elastic_mesh.control.client import CoordinatorClient
from elastic_mesh.control.tls import MemberIdentity
from elastic_mesh.coordinator.run import make_token, start_coordinator
from elastic_mesh.transfer.chunks import lay_out
from elastic_mesh.transfer.fetcher import ChunkFetcher
from elastic_mesh.transfer.server import ChunkServer

FACTS = {"fingerprint": "bench", "procs_per_node": 1, "state_hash": "h0", "address": ""}
CHUNK = 4 << 20


def control(tmp: Path, requests: int) -> dict[str, dict[str, float]]:
    """Median seconds per heartbeat, per arm and way."""
    clients, servers = {}, []
    for tls in (False, True):
        server = start_coordinator(tmp / f"coord-{tls}", tls=tls)
        servers.append(server)
        token = make_token(tmp / f"coord-{tls}", 3600)
        client = CoordinatorClient.for_token(token, request_timeout_s=30, retry_s=10)
        facts = {**FACTS, "tls_public_keys": [MemberIdentity().public_pem]} if tls else FACTS
        client.join(token, name="probe", **facts)
        clients["tls" if tls else "plain"] = client
    times: dict[str, dict[str, list[float]]] = {arm: {"kept": [], "new connection": []} for arm in clients}
    try:
        for i in range(requests + 1):
            for arm, client in clients.items():
                for way in ("kept", "new connection"):
                    if way == "new connection":
                        client.close()
                    started = time.perf_counter()
                    client.post("/v1/heartbeat", {"telemetry": []})
                    if i:  # the first of each is a warm-up
                        times[arm][way].append(time.perf_counter() - started)
    finally:
        for server in servers:
            server.stop()
    return {arm: {way: statistics.median(t) for way, t in ways.items()} for arm, ways in times.items()}


def snapshot(tmp: Path, mib: int, repeats: int) -> dict[str, float]:
    """Median MiB/s of a whole download, per arm."""
    state = {"weights": torch.randn(mib << 18)}  # 4-byte floats: mib MiB
    laid_out = lay_out(1, state, {"outer_step": 1}, chunk_bytes=CHUNK)
    server = start_coordinator(tmp / "coord-snap", tls=True)
    token = make_token(tmp / "coord-snap", 3600)
    client = CoordinatorClient.for_token(token, request_timeout_s=30, retry_s=10)
    identity = MemberIdentity()
    answer = client.join(token, name="seeder", **{**FACTS, "tls_public_keys": [identity.public_pem]})
    key = answer["transfer_key"]
    sources = {}
    for arm in ("plain", "tls"):
        chunk_server = ChunkServer("127.0.0.1", 0, key, keep={"snapshot": 1})
        if arm == "tls":
            chunk_server.tls = identity.server_context(answer["tls_certs"][0])
        chunk_server.publish(laid_out, "snapshot")
        sources[arm] = chunk_server
    rates: dict[str, list[float]] = {arm: [] for arm in sources}
    try:
        for repeat in range(repeats):
            for arm, chunk_server in sources.items():
                fetcher = ChunkFetcher([f"127.0.0.1:{chunk_server.port}"], key, tmp / f"got-{arm}-{repeat}",
                                       timeout_s=60, tls=client.tls_context() if arm == "tls" else None)
                started = time.perf_counter()
                _, tensors, _ = fetcher.fetch("snapshot", 1)
                rates[arm].append(mib / (time.perf_counter() - started))
                assert torch.equal(tensors["weights"], state["weights"])
                del tensors
    finally:
        for chunk_server in sources.values():
            chunk_server.stop()
        server.stop()
    return {arm: statistics.median(r) for arm, r in rates.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="example: python launch/bench/tls_cost.py --requests 300 --mb 256")
    parser.add_argument("--requests", type=int, default=300, help="heartbeats per arm and way")
    parser.add_argument("--mb", type=int, default=256, help="MiB per snapshot download")
    parser.add_argument("--repeats", type=int, default=3, help="downloads per arm")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        c = control(Path(tmp), args.requests)
        s = snapshot(Path(tmp), args.mb, args.repeats)
    print(f"{'control request':<28}{'plain ms':>10}{'tls ms':>10}{'tls/plain':>11}")
    for way in ("kept", "new connection"):
        plain, tls = c["plain"][way] * 1e3, c["tls"][way] * 1e3
        print(f"{way:<28}{plain:>10.2f}{tls:>10.2f}{tls / plain:>11.2f}")
    print(f"{'snapshot ' + str(args.mb) + ' MiB':<28}{'plain MiB/s':>10}{'tls MiB/s':>10}{'tls/plain':>11}")
    print(f"{'':<28}{s['plain']:>10.0f}{s['tls']:>10.0f}{s['tls'] / s['plain']:>11.2f}")
    print(f"tls_cost: control request (kept) plain {c['plain']['kept'] * 1e3:.2f} ms, tls "
          f"{c['tls']['kept'] * 1e3:.2f} ms; new connection plain {c['plain']['new connection'] * 1e3:.2f} ms, "
          f"tls {c['tls']['new connection'] * 1e3:.2f} ms; snapshot plain {s['plain']:.0f} MiB/s, "
          f"tls {s['tls']:.0f} MiB/s ({s['tls'] / s['plain']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
