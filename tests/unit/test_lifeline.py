"""Fast detection of dead processes: a node's lifeline to the coordinator closes when its process dies,
and the coordinator declares it dead at once instead of at the end of its lease. Real processes,
real sockets, a real SIGKILL; silence (a stopped process) is still the lease's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from elastic_mesh.control.client import CoordinatorClient
from elastic_mesh.control.lifeline import LifeLine
from elastic_mesh.coordinator.config import CoordinatorConfig
from elastic_mesh.coordinator.run import make_token, start_coordinator
from tests.conftest import REPO

FACTS = {"fingerprint": "fp1", "procs_per_node": 1, "state_hash": "h0", "address": ""}
LEASE_S = 8.0  # long, so anything faster than it was the lifeline

# A node's process: joins, holds its lifeline, heartbeats, prints its name, then waits to be killed.
NODE = """
import json, sys, time
from elastic_mesh.control.client import CoordinatorClient, Heartbeat
from elastic_mesh.control.lifeline import LifeLine
client = CoordinatorClient(sys.argv[1], request_timeout_s=10, retry_s=5)
answer = client.join(sys.argv[2], name=sys.argv[3], **json.loads(sys.argv[4]))
Heartbeat(client, 0.5).start()
LifeLine(sys.argv[1], answer["node_id"], answer["session"]).start()
print(answer["name"], flush=True)
time.sleep(600)
"""


@pytest.fixture()
def coordinator(tmp_path, request):
    lease_only = getattr(request, "param", False)
    config = CoordinatorConfig(lease_s=LEASE_S, heartbeat_s=0.5, poll_s=1.0, lease_only=lease_only)
    server = start_coordinator(tmp_path / "coord", config=config)
    yield server
    server.stop()


def start_node(server, tmp_path, name: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", NODE, f"127.0.0.1:{server.port}", make_token(tmp_path / "coord", 60),
                             name, json.dumps(FACTS)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == name
    time.sleep(0.5)  # its lifeline is open by now (it opens in the background right after the join)
    return proc


def state_of(server, name: str) -> str:
    return next(n.state for n in server.coordinator.state.nodes() if n.name == name)


def wait_dead(server, name: str, limit_s: float) -> float:
    started = time.monotonic()
    while state_of(server, name) != "dead":
        assert time.monotonic() - started < limit_s, f"{name} still {state_of(server, name)} after {limit_s} s"
        time.sleep(0.02)
    return time.monotonic() - started


def test_a_killed_process_is_declared_dead_at_once(coordinator, tmp_path):
    proc = start_node(coordinator, tmp_path, "a")
    proc.kill()
    seconds = wait_dead(coordinator, "a", LEASE_S / 4)
    proc.wait()
    events = [e["text"] for e in coordinator.coordinator.state.events()]
    assert "a declared dead (its connection closed: the process is gone)" in events, events
    assert seconds < 1.0, seconds


def test_a_silent_process_is_left_to_its_lease(coordinator, tmp_path):
    proc = start_node(coordinator, tmp_path, "b")
    os.kill(proc.pid, signal.SIGSTOP)  # alive, connections open, says nothing: a hung machine
    try:
        seconds = wait_dead(coordinator, "b", LEASE_S + 5)
        assert seconds > LEASE_S - 2, seconds  # not the lifeline: it never closed
        assert any("no heartbeat" in e["text"] for e in coordinator.coordinator.state.events())
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("coordinator", [True], indirect=True)
def test_lease_only_refuses_lifelines_and_waits_for_the_lease(coordinator, tmp_path):
    proc = start_node(coordinator, tmp_path, "c")
    proc.kill()
    proc.wait()
    time.sleep(1.5)
    assert state_of(coordinator, "c") == "active"  # --lease-only: the close counts for nothing


def test_a_leave_then_a_close_is_a_leave_and_a_newer_lifeline_replaces_the_older(coordinator, tmp_path):
    client = CoordinatorClient(f"127.0.0.1:{coordinator.port}", request_timeout_s=10, retry_s=5)
    answer = client.join(make_token(tmp_path / "coord", 60), name="d", **FACTS)
    first = LifeLine(client.address, answer["node_id"], answer["session"]).start()
    time.sleep(0.3)
    second = LifeLine(client.address, answer["node_id"], answer["session"]).start()  # e.g. after a reconnect
    time.sleep(0.5)
    first.stop()
    assert state_of(coordinator, "d") == "active"  # the replaced one's close is no death
    client.post("/v1/leave", {})
    second.stop()
    time.sleep(0.5)
    assert state_of(coordinator, "d") == "left"


def test_a_lifeline_without_a_session_is_refused(coordinator):
    line = LifeLine(f"127.0.0.1:{coordinator.port}", "nobody", "wrong").start()
    deadline = time.monotonic() + 10
    while line.refused is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert "unknown node or wrong session" in line.refused
