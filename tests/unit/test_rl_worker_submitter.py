"""The worker's Submitter against a real orchestrator-style server (JsonServer, a real coordinator's
token check, real HTTP): up to `in_flight` submissions await verification at once, the next waits for
the oldest answer, and an eviction in any answer ends the worker."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from elastic_mesh.control.client import CoordinatorClient
from elastic_mesh.control.token import read_token
from elastic_mesh.coordinator.run import make_token, start_coordinator
from elastic_mesh.control.http import JsonServer, Refused, TokenCheck
from prime.rl.worker.clock import WorkerClock
from prime.rl.worker.session import EXIT_EVICTED, Submitter


class SlowVerification:
    """/v1/rl/submit held until the test releases that lease: a verification that takes as long as the test wants."""

    def __init__(self) -> None:
        self.arrived: list[str] = []
        self.release: dict[str, threading.Event] = {}
        self.lock = threading.Lock()

    def __call__(self, token, body: dict) -> dict:
        lease = body["lease"]
        with self.lock:
            self.arrived.append(lease)
            gate = self.release.setdefault(lease, threading.Event())
        assert gate.wait(20)
        if lease.startswith("rogue"):
            raise Refused(403, "evicted: 1 of 8 rollouts failed verification")
        return {"status": "accepted", "rollouts": len(body["completions"])}

    def let_through(self, lease: str) -> None:
        with self.lock:
            self.release.setdefault(lease, threading.Event()).set()


@pytest.fixture()
def orchestrator(tmp_path):
    coordinator = start_coordinator(tmp_path / "coord")
    worker = make_token(tmp_path / "coord", 600, role="worker")
    verification = SlowVerification()
    server = JsonServer("127.0.0.1", 0, {"/v1/rl/submit": verification},
                        TokenCheck(f"127.0.0.1:{coordinator.port}", read_token(worker).run_id))
    server.start()
    client = CoordinatorClient(f"127.0.0.1:{server.port}", 30, 5, bearer=worker)
    yield client, verification, tmp_path
    server.stop()
    coordinator.stop()


def _clock(tmp_path) -> WorkerClock:
    held = SimpleNamespace(times=lambda: {"announced_at": {}, "fetched_at": {}, "loaded_at": {}})  # no policy needed
    return WorkerClock(tmp_path / "worker.json", held)


def _wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_two_submissions_await_verification_at_once_and_a_third_waits_for_the_oldest(orchestrator):
    client, verification, tmp_path = orchestrator
    clock = _clock(tmp_path)
    submitter = Submitter(client, clock, in_flight=2)
    try:
        assert submitter.submit("a", {"lease": "a", "completions": [{}] * 8}, 8) is None
        assert submitter.submit("b", {"lease": "b", "completions": [{}] * 8}, 8) is None  # did not wait for a
        _wait_until(lambda: sorted(verification.arrived) == ["a", "b"])  # both at the server (either first)
        third = threading.Thread(target=submitter.submit, args=("c", {"lease": "c", "completions": [{}] * 8}, 8))
        third.start()
        time.sleep(0.3)
        assert third.is_alive() and sorted(verification.arrived) == ["a", "b"]  # held back: two await answers
        verification.let_through("b")
        time.sleep(0.3)
        assert third.is_alive()  # it waits for the oldest (a), not for any one
        verification.let_through("a")
        third.join(10)
        assert not third.is_alive()
        _wait_until(lambda: sorted(verification.arrived) == ["a", "b", "c"])
        verification.let_through("c")
        assert submitter.wait() is None
        assert clock.rollouts == 24 and clock.seconds["submit_s"] > 0.2
    finally:
        submitter.close()


def test_an_eviction_in_any_answer_ends_the_worker(orchestrator):
    client, verification, tmp_path = orchestrator
    submitter = Submitter(client, _clock(tmp_path), in_flight=2)
    try:
        assert submitter.submit("honest", {"lease": "honest", "completions": []}, 0) is None
        assert submitter.submit("rogue", {"lease": "rogue", "completions": []}, 0) is None
        verification.let_through("rogue")
        verification.let_through("honest")
        _wait_until(lambda: len(verification.arrived) == 2)
        assert submitter.wait() == EXIT_EVICTED
        with pytest.raises(ValueError, match="at least 1"):
            Submitter(client, _clock(tmp_path), in_flight=0)
    finally:
        submitter.close()
