"""The coordinator over real HTTP: admission, leases, the barrier, votes, bad input, restarts."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from elastic_mesh.control.client import CoordinatorClient, CoordinatorError
from elastic_mesh.control.token import create_token
from elastic_mesh.coordinator.config import CoordinatorConfig
from elastic_mesh.coordinator.run import make_token, start_coordinator

FACTS = {"fingerprint": "fp1", "procs_per_node": 1, "state_hash": "h0", "address": ""}


@pytest.fixture()
def coordinator(tmp_path):
    config = CoordinatorConfig(lease_s=1.5, heartbeat_s=0.3, min_wait_s=1.0, poll_s=1.0)
    server = start_coordinator(tmp_path / "coord", config=config)
    yield server
    server.stop()


def address(server) -> str:
    return f"127.0.0.1:{server.port}"


def joined(server, tmp_path, name="n", **facts) -> CoordinatorClient:
    client = CoordinatorClient(address(server), request_timeout_s=10, retry_s=5)
    client.join(make_token(tmp_path / "coord", 60), name=name, **{**FACTS, **facts})
    return client


def post_raw(server, path, data: bytes, headers=None) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{address(server)}{path}", data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("kind", ["forged", "expired", "foreign", "garbage"])
def test_bad_tokens_are_refused_without_revealing_the_run(coordinator, tmp_path, kind):
    run_id = coordinator.coordinator.run_id
    token = {"forged": create_token(b"z" * 32, address(coordinator), run_id, 60),
             "expired": make_token(tmp_path / "coord", -5),
             "foreign": create_token(b"z" * 32, address(coordinator), "some-other-run", 60),
             "garbage": "not-a-token"}[kind]
    status, body = post_raw(coordinator, "/v1/join", json.dumps({"token": token, **FACTS}).encode())
    assert status == 403
    assert {"forged": "forged", "expired": "expired", "foreign": "another run", "garbage": "not a prime"}[kind] in body["error"]
    if kind != "forged":
        assert run_id not in body["error"]


def test_incompatible_nodes_are_refused_with_the_reason(coordinator, tmp_path):
    joined(coordinator, tmp_path, "a")
    with pytest.raises(CoordinatorError, match="fingerprint fp2 differs from the run's fp1"):
        joined(coordinator, tmp_path, "b", fingerprint="fp2")
    with pytest.raises(CoordinatorError, match="runs 2 processes but the run's nodes run 1"):
        joined(coordinator, tmp_path, "c", procs_per_node=2)
    with pytest.raises(CoordinatorError, match="initial state differs"):
        joined(coordinator, tmp_path, "d", state_hash="other")
    with pytest.raises(CoordinatorError, match="saved state is of round 3, which this run never committed"):
        joined(coordinator, tmp_path, "e", restored_round=3)
    joined(coordinator, tmp_path, "f", work={"data": {"items": 4, "fingerprint": "x"}})  # the first with data sets the run's
    with pytest.raises(CoordinatorError, match="data work .8 items, fingerprint x. differs from the run's .4 items"):
        joined(coordinator, tmp_path, "g", work={"data": {"items": 8, "fingerprint": "x"}})
    with pytest.raises(CoordinatorError, match="diloco.mode is 'delayed' here but None in the run"):
        joined(coordinator, tmp_path, "h", protocol={"diloco.mode": "delayed"})


def test_unauthenticated_requests_are_refused(coordinator, tmp_path):
    client = joined(coordinator, tmp_path, "a")
    assert client.get_status()["nodes"][0]["name"] == "a"  # with its session
    assert CoordinatorClient(address(coordinator)).get_status(make_token(tmp_path / "coord", 60))["run_id"]
    with pytest.raises(CoordinatorError, match="needs a join token") as refused:
        CoordinatorClient(address(coordinator)).get_status()
    assert refused.value.status == 401
    for path in ("/v1/ready", "/v1/store/get", "/v1/store/set", "/v1/heartbeat", "/v1/vote"):
        status, body = post_raw(coordinator, path, b'{"key": "x", "round": 1}',
                                {"X-Prime-Node": "nobody", "X-Prime-Session": "guess"})
        assert status == 401, path


def test_garbage_and_oversized_requests_leave_it_serving(coordinator, tmp_path):
    assert post_raw(coordinator, "/v1/join", b"\xff\xfe garbage")[0] == 400
    assert post_raw(coordinator, "/v1/join", b"[1, 2]")[0] == 400
    with socket.create_connection(("127.0.0.1", coordinator.port)) as raw:
        raw.sendall(b"POST /v1/join HTTP/1.1\r\nHost: x\r\nContent-Length: 2097152\r\n\r\n")
        assert b" 413 " in raw.recv(1000).split(b"\r\n")[0]
    with socket.create_connection(("127.0.0.1", coordinator.port)) as raw:
        raw.sendall(b"\x00\x01garbage that is not http\r\n\r\n")
        raw.recv(100)
    silent = socket.create_connection(("127.0.0.1", coordinator.port))  # says nothing, holds a thread only
    joined(coordinator, tmp_path, "still-works")
    silent.close()


def test_dead_node_is_declared_within_the_lease(coordinator, tmp_path):
    client = joined(coordinator, tmp_path, "a")
    started = time.monotonic()
    while any(n["alive"] for n in client.get_status()["nodes"]):
        assert time.monotonic() - started < 5, "no heartbeat, yet still alive"
        time.sleep(0.1)
    assert client.get_status()["nodes"][0]["state"] == "dead"
    with pytest.raises(CoordinatorError, match="declared dead"):
        client.post("/v1/heartbeat", {}, retry=False)


def _ready(client, step, **kw):
    return client.long_poll("/v1/ready", {"round": step, "contributes": True, "needs_state": False, **kw},
                            lambda a: a.get("status") != "wait", 30)


def _vote(client, plan, ok=True):
    return client.long_poll("/v1/vote", {"round": plan["round"], "attempt": plan["attempt"], "ok": ok},
                            lambda a: "decision" in a, 30)["decision"]


def _together(*calls):
    results = [None] * len(calls)
    threads = [threading.Thread(target=lambda i=i, c=c: results.__setitem__(i, c())) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_barrier_vote_and_abort_then_retry(coordinator, tmp_path):
    a, b = joined(coordinator, tmp_path, "a"), joined(coordinator, tmp_path, "b")
    beats = [threading.Event()]

    def beat():
        while not beats[0].is_set():
            for c in (a, b):
                c.post("/v1/heartbeat", {}, retry=False)
            time.sleep(0.2)
    threading.Thread(target=beat, daemon=True).start()
    try:
        pa, pb = _together(lambda: _ready(a, 1), lambda: _ready(b, 1))
        assert pa["status"] == pb["status"] == "go" and pa["epoch"] == pb["epoch"] and {pa["rank"], pb["rank"]} == {0, 1}
        assert _together(lambda: _vote(a, pa), lambda: _vote(b, pb)) == ["apply", "apply"]
        pa, pb = _together(lambda: _ready(a, 2), lambda: _ready(b, 2))
        assert pa["epoch"] == 1  # same members: no new epoch
        assert _together(lambda: _vote(a, pa, ok=False), lambda: _vote(b, pb)) == ["abort", "abort"]
        pa, pb = _together(lambda: _ready(a, 2), lambda: _ready(b, 2))
        assert pa["attempt"] == 2 and pa["epoch"] == 2  # a retry rendezvouses afresh
        assert _together(lambda: _vote(a, pa), lambda: _vote(b, pb)) == ["apply", "apply"]
        assert _ready(a, 1)["status"] == "missed"
        status = a.get_status()
        assert status["committed_round"] == 2
    finally:
        beats[0].set()


def test_late_node_is_left_out_after_the_deadline(coordinator, tmp_path):
    a, b = joined(coordinator, tmp_path, "a"), joined(coordinator, tmp_path, "b")
    stop = threading.Event()
    threading.Thread(target=lambda: [(a.post("/v1/heartbeat", {}), b.post("/v1/heartbeat", {}), time.sleep(0.2))
                                     for _ in iter(lambda: stop.is_set(), True)], daemon=True).start()
    try:
        started = time.monotonic()
        plan = _ready(a, 1)
        assert plan["world_size"] == 1 and 0.9 <= time.monotonic() - started < 5
        assert _vote(a, plan) == "apply"
        assert _ready(b, 1)["status"] == "missed"
        assert any("left out late node(s) b" in e["text"] for e in a.get_status()["events"])
    finally:
        stop.set()


@contextlib.contextmanager
def _one_node_stepping(coordinator, tmp_path):
    """Node a joined and heartbeating (and every client added to `clients`), with step_alone(step): a
    round a takes by itself, committed."""
    a = joined(coordinator, tmp_path, "a")
    stop, clients = threading.Event(), [a]
    threading.Thread(target=lambda: [([c.post("/v1/heartbeat", {}) for c in list(clients)], time.sleep(0.2))
                                     for _ in iter(lambda: stop.is_set(), True)], daemon=True).start()

    def step_alone(step):
        plan = _ready(a, step)
        assert plan["world_size"] == 1 and _vote(a, plan) == "apply"
        a.post("/v1/commit", {"round": step, "state_hash": f"h{step}"})
    try:
        yield a, clients, step_alone
    finally:
        stop.set()


def test_a_node_catching_up_is_waited_for_at_the_step_it_said_it_will_be_back_for(coordinator, tmp_path):
    """c joins after step 1 and says it will be back for step 3: step 2 goes without it at once, and
    step 3's barrier waits for it although, when a is ready, c holds no committed step yet (it commits
    its replay of step 2 0.2 s later, within one of a's rounds of ~0.7 s). Without the promise step 3
    would go without c at once."""
    with _one_node_stepping(coordinator, tmp_path) as (a, clients, step_alone):
        step_alone(1)
        c = joined(coordinator, tmp_path, "c")
        clients.append(c)
        assert c.post("/v1/will_join", {"round": 1})["status"] == "missed"
        with pytest.raises(CoordinatorError, match="more than one round after"):
            c.post("/v1/will_join", {"round": 4}, retry=False)
        assert c.post("/v1/will_join", {"round": 3})["status"] == "ok"
        time.sleep(0.7)  # a's inner steps
        started = time.monotonic()
        step_alone(2)  # c said 3, not 2: nobody waits for it here
        assert time.monotonic() - started < 0.9

        def c_replays_then_joins():
            time.sleep(0.9)
            c.post("/v1/commit", {"round": 2, "state_hash": "h2"})
            return _ready(c, 3)
        pa, pc = _together(lambda: (time.sleep(0.7), _ready(a, 3))[1], c_replays_then_joins)
        assert pa["status"] == pc["status"] == "go" and pa["world_size"] == pc["world_size"] == 2, (pa, pc)
        assert c.post("/v1/will_join", {"round": 3})["status"] == "missed"  # its members are fixed
        assert not any("left out" in e["text"] for e in a.get_status()["events"])


def test_a_node_back_from_a_catch_up_costs_the_others_one_ordinary_round_at_most(coordinator, tmp_path):
    """a's rounds come every ~0.3 s. c says it will be back for step 5 and does not come: step 5 goes
    without it after about one ordinary round, not after the 1 s deadline a node holding the last
    step would get. (Before, a joiner's last replay and first steps could hold a round for 2.6 s.)"""
    with _one_node_stepping(coordinator, tmp_path) as (a, clients, step_alone):
        for step in range(1, 4):
            step_alone(step)
            time.sleep(0.3)  # the inner steps of an ordinary round
        c = joined(coordinator, tmp_path, "c")
        clients.append(c)
        assert c.post("/v1/will_join", {"round": 5})["status"] == "ok"
        step_alone(4)
        time.sleep(0.3)
        started = time.monotonic()
        step_alone(5)
        waited = time.monotonic() - started
        assert 0.2 <= waited < 0.8, waited
        assert any("round 5: left out late node(s) c" in e["text"] for e in a.get_status()["events"])


def test_rendezvous_store_needs_credentials_and_survives_restart(tmp_path):
    config = CoordinatorConfig(lease_s=30, poll_s=1.0)
    server = start_coordinator(tmp_path / "coord", config=config)
    client = joined(server, tmp_path, "a")
    from elastic_mesh.control.store import CoordinatorStore

    assert _ready(client, 1)["epoch"] == 1  # only an epoch's members use its keys (test_round_strikes.py)
    store = CoordinatorStore(client, "e1/r0/", timeout_s=5)
    store.set("k", b"\x00\x01value")
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    port = server.port
    server.stop()
    server = start_coordinator(tmp_path / "coord", port=port, config=config)
    try:
        assert store.get("k") == b"\x00\x01value" and store.check(["k"]) and not store.check(["missing"])
        with pytest.raises(CoordinatorError, match="epoch 1 was aborted"):  # by the restart: never completes
            CoordinatorStore(client, "e1/r0/", timeout_s=1.5).get("missing")
        assert _ready(client, 1)["epoch"] == 2
        with pytest.raises(CoordinatorError, match="did not appear"):
            CoordinatorStore(client, "e2/r0/", timeout_s=1.5).get("missing")
    finally:
        server.stop()


def test_telemetry_is_cleaned_kept_across_restarts_and_shown_per_node(tmp_path):
    config = CoordinatorConfig(lease_s=30, poll_s=1.0)
    server = start_coordinator(tmp_path / "coord", config=config)
    client = joined(server, tmp_path, "alpha")
    records = [{"step": 1, "loss": 5.5, "tokens": 512, "time": 1.0},
               {"step": 2, "loss": float("nan"), "tokens": 1024, "evil": "x" * 100},  # NaN and unknown field dropped
               {"outer_step": 1, "allreduce_s": 0.5, "bytes_sent": 1_000_000, "tokens_contributed": 1024},
               "not a record", {"loss": True}, {}]
    client.post("/v1/heartbeat", {"telemetry": records})
    client.post("/v1/heartbeat", {"telemetry": "garbage"})  # ignored, the heartbeat still counts
    node = client.get_status()["nodes"][0]
    assert node["step"] == 2 and node["loss"] == 5.5 and node["link_mbit_s"] == 16.0 and node["last_heartbeat_s"] < 5
    port = server.port
    server.stop()
    server = start_coordinator(tmp_path / "coord", port=port, config=config)
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/history?after=0",
                                         headers={"Authorization": f"Bearer {make_token(tmp_path / 'coord', 60)}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            kept = json.loads(response.read())
        assert kept["records"] == [
            {"node": "alpha", "step": 1, "loss": 5.5, "tokens": 512, "time": 1.0},
            {"node": "alpha", "step": 2, "tokens": 1024},
            {"node": "alpha", "outer_step": 1, "allreduce_s": 0.5, "bytes_sent": 1_000_000, "tokens_contributed": 1024}]
        later = urllib.request.Request(f"http://127.0.0.1:{port}/v1/history?after={kept['last_id']}",
                                       headers=request.headers)
        with urllib.request.urlopen(later, timeout=10) as response:
            assert json.loads(response.read())["records"] == []
    finally:
        server.stop()


def test_waiting_for_a_commit_ends_when_no_other_member_is_left(coordinator, tmp_path):
    """A node catching up waits for the next commit; once every other member has left, none can come,
    and the wait ends at once with `alone` instead of lasting barrier_timeout_s (an hour)."""
    a = joined(coordinator, tmp_path, "a")
    plan = _ready(a, 1)
    assert _vote(a, plan) == "apply"
    a.post("/v1/commit", {"round": 1, "state_hash": "h1"})
    c = joined(coordinator, tmp_path, "c")
    assert c.post("/v1/wait_commit", {"after": 1}) == {"status": "wait"}  # a is live: a commit may come
    assert c.post("/v1/sources", {})["alone"] is False
    a.post("/v1/leave", {})
    started = time.monotonic()
    assert c.post("/v1/wait_commit", {"after": 1}) == {"committed_round": 1, "alone": True}
    assert time.monotonic() - started < 0.5 and c.post("/v1/sources", {})["alone"] is True
