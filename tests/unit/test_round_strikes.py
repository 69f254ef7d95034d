"""A node token cannot hold rounds up (issue 50, item 9): the rendezvous store belongs to each epoch's
members, and a member that does not show up, does not vote, or reports work it does not hold costs the
others one attempt, is left out of the retry and gets its token banned after max_strikes. Real
coordinator, real HTTP; the misbehaving node is a plain client doing (or not doing) what a node does."""

from __future__ import annotations

import base64
import time

import pytest

from elastic_mesh.control.client import CoordinatorClient, CoordinatorError
from elastic_mesh.control.store import CoordinatorStore
from elastic_mesh.coordinator.config import CoordinatorConfig
from elastic_mesh.coordinator.run import make_token, start_coordinator
from tests.unit.test_coordinator import FACTS, _ready, _together, _vote, address


@pytest.fixture()
def server(tmp_path):
    # Long liveness leases: no heartbeats needed; short graces so a held-up attempt ends in about a second.
    config = CoordinatorConfig(lease_s=60, min_wait_s=5.0, poll_s=1.0, show_up_grace_s=1.0, vote_grace_s=1.0,
                               max_strikes=2)
    server = start_coordinator(tmp_path / "coord", config=config)
    yield server
    server.stop()


def _join(server, tmp_path, name) -> tuple[CoordinatorClient, str]:
    token = make_token(tmp_path / "coord", 60)
    client = CoordinatorClient(address(server), request_timeout_s=10, retry_s=2)
    client.join(token, name=name, **FACTS)
    return client, token


def _after(delay_s: float, call):
    time.sleep(delay_s)
    return call()


def _set(client, key: str, value: bytes) -> dict:
    return client.post("/v1/store/set", {"key": key, "value": base64.b64encode(value).decode()}, retry=False)


def test_rendezvous_keys_belong_to_the_epochs_members_and_are_written_once(server, tmp_path):
    (a, _), (b, _) = _join(server, tmp_path, "a"), _join(server, tmp_path, "b")
    pa, pb = _together(lambda: _ready(a, 1), lambda: _ready(b, 1))
    assert pa["epoch"] == pb["epoch"] == 1 and (pa["rank"], pb["rank"]) == (0, 1)
    outsider, _ = _join(server, tmp_path, "c")
    refused = {
        "not a member": lambda: _set(outsider, "e1/r0/0/0", b"me"),
        "rank 1's address": lambda: _set(a, "e1/r0/0/1", b"me"),
        "set already": lambda: (_set(a, "e1/r0/0/0", b"addr-a"), _set(a, "e1/r0/0/0", b"other")),
        "at most 65536 bytes": lambda: _set(a, "e1/r0/0/9", bytes(65537)),
        "rendezvous keys are": lambda: _set(a, "../nodes", b"x"),
    }
    for why, attempt in refused.items():
        with pytest.raises(CoordinatorError, match=why):
            attempt()
    _set(a, "e1/r0/0/0", b"addr-a")  # the same value again: a retried request
    assert CoordinatorStore(b, "e1/r0/", 5).get("0/0") == b"addr-a"
    with pytest.raises(CoordinatorError, match="not a member of epoch 1"):
        CoordinatorStore(outsider, "e1/r0/", 5).get("0/0")
    with pytest.raises(CoordinatorError, match="not a member of epoch 7"):
        CoordinatorStore(a, "e7/r0/", 5).check(["0/0"])


def test_a_no_show_costs_one_attempt_and_a_silent_member_another_then_its_token_is_banned(server, tmp_path):
    (a, _), (b, _), (rogue, rogue_token) = (_join(server, tmp_path, n) for n in ("a", "b", "rogue"))
    plans = _together(lambda: _ready(a, 1), lambda: _ready(b, 1), lambda: _ready(rogue, 1))
    assert {p["world_size"] for p in plans} == {3}
    # a and b begin the attempt, publish their addresses and wait for the rogue's, which never comes.
    started = time.monotonic()
    for client, plan in zip((a, b), plans):
        client.post("/v1/present", {"round": 1, "attempt": plan["attempt"]})
        _set(client, f"e{plan['epoch']}/r0/0/{plan['rank']}", f"addr-{plan['rank']}".encode())
    with pytest.raises(CoordinatorError, match="aborted"):
        CoordinatorStore(a, f"e{plans[0]['epoch']}/r0/", 30).get(f"0/{plans[2]['rank']}")
    assert time.monotonic() - started < 6  # the grace (1 s) and a tick, not Gloo's own time-out
    assert _together(lambda: _vote(a, plans[0], ok=False), lambda: _vote(b, plans[1], ok=False)) == ["abort"] * 2
    # The retry goes on without it: the rogue is told round 1 went on without it.
    assert _ready(rogue, 1)["status"] == "missed"
    pa, pb = _together(lambda: _ready(a, 1), lambda: _ready(b, 1))
    assert pa["attempt"] == 2 and pa["world_size"] == 2
    assert _together(lambda: _vote(a, pa), lambda: _vote(b, pb)) == ["apply", "apply"]
    for client in (a, b):
        client.post("/v1/commit", {"round": 1, "state_hash": "h1"})
    strikes = a.get_status()["strikes"]
    assert [(s["node"], s["kind"]) for s in strikes] == [("rogue", "no-show")]

    # Round 2: the rogue takes part in the transfer but never votes; the others voted ok. (It is ready
    # first: a node that does not hold round 1 is not waited for.)
    plans = _together(lambda: _after(0.5, lambda: _ready(a, 2)), lambda: _after(0.5, lambda: _ready(b, 2)),
                      lambda: _ready(rogue, 2))
    assert {p["world_size"] for p in plans} == {3}
    started = time.monotonic()

    def vote_after_a_transfer_of(client, plan, seconds):  # a slow-linked member may finish that much later
        return client.long_poll("/v1/vote", {"round": plan["round"], "attempt": plan["attempt"], "ok": True,
                                             "allreduce_s": seconds}, lambda answer: "decision" in answer, 30)["decision"]
    assert _together(lambda: vote_after_a_transfer_of(a, plans[0], 2.5),
                     lambda: vote_after_a_transfer_of(b, plans[1], 2.5)) == ["abort", "abort"]
    assert 2.5 <= time.monotonic() - started < 8
    status = a.get_status()
    assert [(s["node"], s["kind"]) for s in status["strikes"]] == [("rogue", "no-show"), ("rogue", "silent")]
    assert {n["name"]: n["state"] for n in status["nodes"]}["rogue"] == "evicted"  # 2 strikes: banned
    with pytest.raises(CoordinatorError, match="evicted|join again"):
        _ready(rogue, 2)
    with pytest.raises(CoordinatorError, match="banned"):
        CoordinatorClient(address(server), request_timeout_s=10, retry_s=2).join(rogue_token, name="rogue2", **FACTS)
    pa, pb = _together(lambda: _ready(a, 2), lambda: _ready(b, 2))
    assert pa["world_size"] == 2 and _together(lambda: _vote(a, pa), lambda: _vote(b, pb)) == ["apply", "apply"]


def test_a_work_report_that_is_not_the_nodes_aborts_at_once_and_strikes_it(server, tmp_path):
    (a, _), (rogue, _) = _join(server, tmp_path, "a"), _join(server, tmp_path, "rogue")
    pa, pr = _together(lambda: _ready(a, 1), lambda: _ready(rogue, 1))
    forged = {"data": [{"worker": 0, "item": 0, "pass": 0, "start": [], "end": [99], "finished": False}]}
    with pytest.raises(CoordinatorError, match="work report refused"):
        rogue.post("/v1/vote", {"round": 1, "attempt": pr["attempt"], "ok": True, "consumed": forged}, retry=False)
    assert _vote(a, pa) == "abort"  # at once: before, the attempt waited for the rogue's vote for ever
    assert [s["kind"] for s in a.get_status()["strikes"]] == ["work report"]
    assert _ready(a, 1)["world_size"] == 1


def test_a_node_that_looks_in_step_but_never_comes_costs_one_deadline_not_one_per_round(server, tmp_path):
    """The rogue commits each round's majority hash (so it holds the last round, as far as the barrier can
    tell) and never declares ready: the barrier waits the deadline for it once, then no more until it is
    ready within a deadline of a round's first node."""
    (a, _), (rogue, _) = _join(server, tmp_path, "a"), _join(server, tmp_path, "rogue")
    waits = []
    for number in range(1, 5):
        started = time.monotonic()
        plan = _ready(a, number)
        waits.append(time.monotonic() - started)
        assert plan["world_size"] == 1 and _vote(a, plan) == "apply"
        a.post("/v1/commit", {"round": number, "state_hash": f"h{number}"})
        rogue.post("/v1/commit", {"round": number, "state_hash": f"h{number}"})  # looks in step for the next
    assert waits[0] >= 4.5 and max(waits[1:]) < 2, waits  # the 5 s deadline once
    assert len(server.coordinator.rounds.unwaited) == 1
    # Ready in time again (within a deadline of the round's first node, if after the round was fixed): it
    # is told the round went on without it, and is waited for again from the next round on.
    plan = _ready(a, 5)
    late = _together(lambda: _ready(rogue, 5), lambda: _after(0.5, lambda: (_vote(a, plan), a.post(
        "/v1/commit", {"round": 5, "state_hash": "h5"}))))[0]
    assert late["status"] == "missed"
    assert server.coordinator.rounds.unwaited == set()  # was {the rogue's node id} since round 1
