"""Broadcast faults with real processes and sockets: a relay that lies, a relay SIGKILLed mid-transfer, the
origin killed once a full verified copy exists elsewhere, and tokens that must be refused.

Every member is its own process: the coordinator and the members are started through their command
lines (`python -m elastic_mesh.coordinator`, `python -m elastic_mesh.broadcast`); the misbehaving ones
through tests/e2e/broadcast_faults.py, which uses the chunk server's fault seams."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_mesh.control.token import create_token
from elastic_mesh.coordinator.run import make_token
from launch.cluster import wait_for
from tests.conftest import REPO, child_env

CHUNK_MB = "0.25"


class Run:
    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs = tmp, []
        self.state = tmp / "coord"
        self.coordinator = self.start([sys.executable, "-m", "elastic_mesh.coordinator", "serve", "--host", "127.0.0.1",
                                       "--port", "0", "--state-dir", str(self.state), "--holder-ttl-s", "4"],
                                      "coordinator")
        wait_for(lambda: (self.state / "address").exists(), 60, "the coordinator")
        self.payload = tmp / "payload" / "weights.bin"
        self.payload.parent.mkdir()
        self.payload.write_bytes(os.urandom(6 << 20))

    def token(self, **kw) -> str:
        return make_token(self.state, 3600, **kw)

    def start(self, cmd: list[str], name: str) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=open(self.tmp / f"{name}.log", "w"),
                                stderr=subprocess.STDOUT, text=True)
        self.procs.append(proc)
        return proc

    def member(self, name: str, *args: str) -> subprocess.Popen:
        return self.start([sys.executable, "-m", "elastic_mesh.broadcast", *args, "--kind", "policy",
                           "--host", "127.0.0.1", "--chunk-mb", CHUNK_MB, "--timeout-s", "5", "--stall-s", "20"], name)

    def fetch(self, name: str, token: str, *args: str) -> subprocess.Popen:
        return self.member(name, "fetch", "--token", token, "--out", str(self.tmp / name / "out"), "--work-dir",
                           str(self.tmp / name / "work"), "--report", str(self.tmp / f"{name}.json"), "--wait-s", "60",
                           *args)

    def faulty(self, name: str, *args: str) -> tuple[subprocess.Popen, str]:
        proc = self.start([sys.executable, "-m", "tests.e2e.broadcast_faults", *args, "--work-dir",
                           str(self.tmp / name), "--chunk-mb", CHUNK_MB], name)
        line = wait_for(lambda: next((ln for ln in self.log(name).splitlines() if ln.startswith("serving at")), None),
                        90, f"{name} serving")
        return proc, line.split()[-1]

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def report(self, name: str) -> dict:
        return json.loads((self.tmp / f"{name}.json").read_text())

    def check_copy(self, name: str, proc: subprocess.Popen, timeout: float = 120) -> dict:
        wait_for(lambda: (self.tmp / f"{name}.json").exists() or proc.poll() is not None, timeout, f"{name}'s copy")
        assert (self.tmp / f"{name}.json").exists(), f"{name} exited {proc.poll()}:\n{self.log(name)[-3000:]}"
        out = self.tmp / name / "out" / "weights.bin"
        assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(self.payload.read_bytes()).digest()
        return self.report(name)

    def status_events(self) -> str:
        db = self.state / "coordinator.sqlite"
        import sqlite3

        return " ".join(r[0] for r in sqlite3.connect(db).execute("SELECT text FROM events"))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def run(tmp_path):
    r = Run(tmp_path)
    yield r
    r.stop()


def publish(run: Run) -> subprocess.Popen:
    origin = run.member("origin", "publish", "--token", run.token(publish=True), "--version", "1", "--report",
                        str(run.tmp / "origin.json"), str(run.payload))
    wait_for(lambda: (run.tmp / "origin.json").exists() or origin.poll() is not None, 90, "the publication")
    assert origin.poll() is None, run.log("origin")
    return origin


def test_a_relay_that_serves_corrupt_bytes_is_banned_named_and_the_download_completes(run):
    publish(run)
    liar, liar_address = run.faulty("liar", "liar", "--token", run.token(role="worker"))
    port = next(ln.split(" on port ")[1].split()[0] for ln in run.log("origin").splitlines() if " on port " in ln)
    client = run.fetch("client", run.token(role="worker"), "--from", f"{liar_address},127.0.0.1:{port}")
    report = run.check_copy("client", client)
    assert report["corrupt"] and all(c.endswith(liar_address) for c in report["corrupt"])
    assert liar_address not in report["bytes_from"]
    assert f"{liar_address} sent a bad chunk" in run.log("client")
    assert f"from {liar_address} did not match its signed hash" in run.status_events()
    assert "banned from serving policy: its own signed statement" in run.status_events()


def test_a_relay_killed_mid_transfer_is_replaced_and_every_client_finishes(run):
    slow, origin_address = run.faulty("origin", "slow-origin", "--token", run.token(publish=True), "--file",
                                      str(run.payload), "--delay-s", "0.15")
    worker = run.token(role="worker", max_nodes=4)
    relay = run.member("relay", "relay", "--token", worker, "--work-dir", str(run.tmp / "relay"))
    clients = {f"client{i}": run.fetch(f"client{i}", worker) for i in range(2)}
    # The relay holds some chunks and serves them when it dies: SIGKILL, like a machine lost.
    wait_for(lambda: len(list((run.tmp / "relay" / "policy").glob("v*/chunk_*"))) >= 4, 60, "the relay's first chunks")
    relay.send_signal(signal.SIGKILL)
    assert len(list((run.tmp / "relay" / "policy").glob("v*/chunk_*"))) < 24  # mid-transfer: 24 chunks in all
    for name, proc in clients.items():
        run.check_copy(name, proc)
    assert slow.poll() is None


def test_every_client_finishes_after_the_origin_dies_once_a_full_copy_exists_elsewhere(run):
    origin = publish(run)
    worker = run.token(role="worker", max_nodes=4)
    first = run.fetch("first", worker, "--serve-s", "120")
    run.check_copy("first", first)
    origin.send_signal(signal.SIGKILL)
    origin.wait()
    late = {f"late{i}": run.fetch(f"late{i}", worker) for i in range(2)}
    for name, proc in late.items():
        report = run.check_copy(name, proc)
        assert sum(report["bytes_from"].values()) == report["bytes"]
        assert len(report["bytes_from"]) >= 1


def test_clients_without_a_valid_token_of_this_run_are_refused_and_fetch_nothing(run):
    publish(run)
    address = (run.state / "address").read_text().strip()
    cases = {
        "garbage": ("not-a-token", "not a prime join token"),
        "foreign": (create_token(b"k" * 32, address, "run-other", 3600, "worker"), "another run"),
        "observer": (run.token(role="observer"), "observer token reads the status only"),
    }
    for name, (token, reason) in cases.items():
        proc = run.fetch(name, token)
        assert proc.wait(60) == 1, run.log(name)
        assert reason in run.log(name)
        assert not (run.tmp / name / "out").exists()
