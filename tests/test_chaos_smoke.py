"""Chaos smoke: a running cluster takes hostile input on every port it listens on, plus a forged
token, and still trains to the end with identical models. (The full soak is launch/bench/chaos_soak.py.)"""

from __future__ import annotations

import json
import os
import random
import socket
import time
import urllib.error
import urllib.request

from elastic_mesh.process_tree import descendants
from elastic_mesh.token import create_token
from launch.cluster import LocalCluster


def listening_ports(pids: set[int]) -> set[int]:
    """TCP ports in LISTEN state owned by any of pids (from /proc, no external tools)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A = LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def hostile(port: int, rng: random.Random) -> None:
    payloads = [bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 4096))),
                b"GET / HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n",
                b"\x00" * 65536, b"POST /v1/store/set HTTP/1.1\r\nContent-Length: 5\r\n\r\n{bad}"]
    for payload in payloads:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(payload)
                s.settimeout(0.5)
                try:
                    s.recv(100)
                except (socket.timeout, OSError):
                    pass
        except OSError:
            pass


def test_hostile_input_on_every_listening_port(tmp_path, corpus):
    overrides = ["--data.path", str(corpus), "--train.max_steps", "60", "--diloco.inner_steps", "5",
                 "--train.eval_every", "0", "--checkpoint.every", "0", "--chaos.step_delay_s", "0.1",
                 "--mesh.transfer_timeout_s", "10"]
    with LocalCluster(tmp_path / "run", "configs/debug.toml", overrides,
                      coordinator_args=["--lease-s", "4", "--min-wait-s", "3"]) as c:
        c.start_coordinator(start_nodes=2)
        c.start_node("node0")
        c.start_node("node1")
        deadline = time.monotonic() + 120
        while len(c.outer_records("node0")) < 2:
            assert time.monotonic() < deadline, c.log("node0")[-2000:]
            time.sleep(0.2)
        pids = {c.coordinator.pid}
        for proc in c.nodes.values():
            pids |= {proc.pid, *descendants(proc.pid)}
        ports = listening_ports(pids)
        assert c.port in ports and len(ports) >= 3, ports  # coordinator, torchrun stores, Gloo pairs
        rng = random.Random(0)
        for port in sorted(ports):
            hostile(port, rng)
        forged = create_token(b"x" * 32, f"127.0.0.1:{c.port}", "run-x", 60)
        request = urllib.request.Request(f"http://127.0.0.1:{c.port}/v1/join",
                                         data=json.dumps({"token": forged}).encode())
        try:
            urllib.request.urlopen(request, timeout=10)
            raise AssertionError("a forged token was accepted")
        except urllib.error.HTTPError as e:
            assert e.code == 403
        codes = c.wait_nodes(240)
        assert codes == {"node0": 0, "node1": 0}, (sorted(ports), c.log("node0")[-3000:])
        h0, h1 = c.outer_records("node0"), c.outer_records("node1")
        assert max(h0) == 12 and all(h0[k]["model_hash"] == h1[k]["model_hash"] for k in h0)
        print(f"survived hostile input on {len(ports)} listening ports: {sorted(ports)}")
