"""Tokens with scope, over real HTTP against a real coordinator: a role, a cap on the live nodes one
token admits, revocation by id (through the real command line), and one vote per token at commit."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from elastic_mesh.control.client import CoordinatorClient, CoordinatorError
from elastic_mesh.control.token import read_token
from elastic_mesh.coordinator.config import CoordinatorConfig
from elastic_mesh.coordinator.run import make_token, start_coordinator
from tests.conftest import REPO
from tests.unit.test_coordinator import FACTS, _ready, _together, _vote


@pytest.fixture()
def coordinator(tmp_path):
    server = start_coordinator(tmp_path / "coord", config=CoordinatorConfig(lease_s=30, poll_s=1.0, start_nodes=3))
    yield server
    server.stop()


def join(server, token: str, name: str) -> CoordinatorClient:
    client = CoordinatorClient(f"127.0.0.1:{server.port}", request_timeout_s=10, retry_s=5)
    client.join(token, name=name, **FACTS)
    return client


def state_of(server, name: str) -> str:
    """The state of the newest node of that name (a node that joined again has an older, ended record)."""
    return [n.state for n in server.coordinator.state.nodes() if n.name == name][-1]


def test_a_token_admits_at_most_its_cap_and_the_same_name_again_replaces_the_restarted_node(coordinator, tmp_path):
    token = make_token(tmp_path / "coord", 60)  # the default: one live node
    first = join(coordinator, token, "alice")
    with pytest.raises(CoordinatorError, match="admits at most 1 live node.s. and alice holds it"):
        join(coordinator, token, "mallory")  # a leaked token adds no second node
    again = join(coordinator, token, "alice")  # alice restarted before her old session expired
    assert state_of(coordinator, "alice") == "active"
    with pytest.raises(CoordinatorError, match="was declared dead"):
        first.post("/v1/heartbeat", {}, retry=False)  # the old session is over
    again.post("/v1/leave", {})
    join(coordinator, token, "bob")  # once none is live, the token admits again
    two = make_token(tmp_path / "coord", 60, max_nodes=2)
    join(coordinator, two, "c1")
    join(coordinator, two, "c2")
    with pytest.raises(CoordinatorError, match="admits at most 2"):
        join(coordinator, two, "c3")


def test_roles_an_observer_reads_the_status_and_cannot_join(coordinator, tmp_path):
    observer = make_token(tmp_path / "coord", 60, role="observer")
    with pytest.raises(CoordinatorError, match="this is an observer token: it cannot join"):
        join(coordinator, observer, "eve")
    status = CoordinatorClient(f"127.0.0.1:{coordinator.port}").get_status(observer)
    assert status["run_id"] == coordinator.coordinator.run_id


def test_revoking_a_token_ends_its_sessions_at_once_and_refuses_it(coordinator, tmp_path):
    state_dir = tmp_path / "coord"
    token, observer = make_token(state_dir, 60), make_token(state_dir, 60, role="observer")
    node = join(coordinator, token, "leaky")
    node.post("/v1/heartbeat", {}, retry=False)
    token_id = read_token(token).token_id

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "elastic_mesh.coordinator", "token", *args, "--state-dir",
                               str(state_dir)], cwd=REPO, capture_output=True, text=True, timeout=60)
    listed = cli("list")
    assert listed.returncode == 0 and f"{token_id}  node" in listed.stdout and "valid" in listed.stdout
    revoked = cli("revoke", token_id)
    assert revoked.returncode == 0, revoked.stderr
    with pytest.raises(CoordinatorError, match="was revoked"):
        node.post("/v1/heartbeat", {}, retry=False)  # its very next request
    assert state_of(coordinator, "leaky") == "evicted"
    assert any(f"its token {token_id} was revoked" in e["text"] for e in coordinator.coordinator.state.events())
    with pytest.raises(CoordinatorError, match=f"token {token_id} was revoked"):
        join(coordinator, token, "leaky")
    assert "revoked" in cli("list").stdout
    assert cli("revoke", "no-such-id").returncode == 2
    cli("revoke", read_token(observer).token_id)
    with pytest.raises(CoordinatorError, match="needs a join token"):
        CoordinatorClient(f"127.0.0.1:{coordinator.port}").get_status(observer)


def test_extra_nodes_on_one_token_gain_no_votes_at_commit(coordinator, tmp_path):
    """An honest node and two nodes on one leaked token (cap 2) commit different hashes after the same
    round. Counted per node the two would win and the honest one would be told to resync; counted per
    token it is one against one, and the tie goes to the node admitted first."""
    honest = join(coordinator, make_token(tmp_path / "coord", 60), "honest")
    leaked = make_token(tmp_path / "coord", 60, max_nodes=2)
    b, c = join(coordinator, leaked, "b"), join(coordinator, leaked, "c")
    stop = threading.Event()
    threading.Thread(target=lambda: [([x.post("/v1/heartbeat", {}) for x in (honest, b, c)], time.sleep(0.3))
                                     for _ in iter(stop.is_set, True)], daemon=True).start()
    try:
        plans = _together(*(lambda x=x: _ready(x, 1) for x in (honest, b, c)))
        assert all(p["status"] == "go" for p in plans) and plans[0]["world_size"] == 3
        assert _together(*(lambda x=x, p=p: _vote(x, p) for x, p in zip((honest, b, c), plans))) == ["apply"] * 3
        answers = [x.post("/v1/commit", {"round": 1, "state_hash": h}) for x, h in
                   ((honest, "good"), (b, "evil"), (c, "evil"))]
    finally:
        stop.set()
    assert [a["majority_hash"] for a in answers] == ["good"] * 3
    assert [a["status"] for a in answers] == ["ok", "diverged", "diverged"]


def test_a_worker_token_names_its_compute_dtype_and_a_worker_of_another_dtype_will_not_start(coordinator, tmp_path):
    """token create --attributes dtype=bfloat16 (the real command line) signs the dtype into the token; a
    worker started with another --dtype refuses to start, saying how to fix it, before it contacts anyone."""
    made = subprocess.run([sys.executable, "-m", "elastic_mesh.coordinator", "token", "create", "--state-dir",
                           str(tmp_path / "coord"), "--role", "worker", "--attributes", "dtype=bfloat16"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0 and "dtype=bfloat16" in made.stderr, made.stderr
    token = made.stdout.strip()
    assert read_token(token).attributes == {"dtype": "bfloat16"}
    bad = subprocess.run([sys.executable, "-m", "elastic_mesh.coordinator", "token", "create", "--state-dir",
                          str(tmp_path / "coord"), "--attributes", "dtype"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr
    from prime.rl.worker.config import WorkerConfig
    from prime.rl.worker.worker import EXIT_REFUSED, InferenceWorker
    assert InferenceWorker.join(WorkerConfig(dtype="float32"), token, tmp_path / "w") == EXIT_REFUSED
