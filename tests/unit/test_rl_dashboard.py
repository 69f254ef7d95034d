"""The RL dashboard's server side: the events it keeps, and who may read it, against a real coordinator
over real HTTP. (The page itself is rendered by Chromium in tests/e2e/test_rl.py, on a live run.)"""

from __future__ import annotations

import http.client

import pytest

from elastic_mesh.control.client import CoordinatorClient, CoordinatorError
from elastic_mesh.control.token import create_token, read_token
from elastic_mesh.coordinator.run import make_token, start_coordinator
from prime.rl.orchestrator.dashboard import PAGES, PATH, RunHistory
from elastic_mesh.control.http import JsonServer, Route, TokenCheck


def test_the_history_keeps_what_the_charts_need_numbered_and_bounded():
    history = RunHistory(keep=3)
    history.add({"event": "batch", "step": 0, "time_s": 1.0, "reward_mean": 0.1, "prompt_numbers": list(range(99)),
                 "leased_to_arrived_s": 0.3, "asked_to_built_s": 0.2})
    history.add({"event": "eval", "version": 0, "time_s": 1.5, "eval_reward": 0.05})
    history.add({"event": "something else", "time_s": 2.0})  # not for the dashboard
    history.add({"event": "evicted", "worker": "w1", "reason": "forged proof", "time_s": 2.5})
    events, last = history.after(0)
    assert [(e["id"], e["event"]) for e in events] == [(1, "batch"), (2, "eval"), (3, "evicted")] and last == 3
    assert "prompt_numbers" not in events[0] and events[0]["reward_mean"] == 0.1
    assert events[0]["leased_to_arrived_s"] == 0.3 and events[0]["asked_to_built_s"] == 0.2  # the path chart's
    assert history.after(2) == ([events[2]], 3) and history.after(3) == ([], 3)
    history.add({"event": "batch", "step": 1, "time_s": 3.0})
    assert [e["id"] for e in history.after(0)[0]] == [2, 3, 4]  # the oldest went


@pytest.fixture()
def service(tmp_path):
    coordinator = start_coordinator(tmp_path / "coord")
    own = make_token(tmp_path / "coord", 600, role="worker")
    check = TokenCheck(f"127.0.0.1:{coordinator.port}", read_token(own).run_id)
    routes = {PATH: lambda token, body: {"role": token.role}, "/v1/rl/lease": lambda token, body: {"role": token.role}}
    server = JsonServer("127.0.0.1", 0, {**routes, PATH: Route(routes[PATH], read_only=True)}, check, pages=PAGES)
    server.start()
    yield server, tmp_path
    server.stop()
    coordinator.stop()


def test_any_token_of_the_run_reads_the_dashboard_and_only_work_tokens_take_work(service):
    server, tmp_path = service
    address = f"127.0.0.1:{server.port}"
    observer = make_token(tmp_path / "coord", 600, role="observer")
    worker = make_token(tmp_path / "coord", 600, role="worker")
    assert CoordinatorClient(address, 10, 5, bearer=observer).post(PATH, {}) == {"role": "observer"}
    assert CoordinatorClient(address, 10, 5, bearer=worker).post(PATH, {}) == {"role": "worker"}
    assert CoordinatorClient(address, 10, 5, bearer=worker).post("/v1/rl/lease", {}) == {"role": "worker"}
    with pytest.raises(CoordinatorError, match="observer token reads the status only"):
        CoordinatorClient(address, 10, 5, bearer=observer).post("/v1/rl/lease", {}, retry=False)
    forged = create_token(b"x" * 32, "127.0.0.1:1", read_token(worker).run_id, 600, role="observer")
    with pytest.raises(CoordinatorError) as refused:
        CoordinatorClient(address, 10, 5, bearer=forged).post(PATH, {}, retry=False)
    assert refused.value.status == 403
    with pytest.raises(CoordinatorError) as refused:
        CoordinatorClient(address, 10, 5).post(PATH, {}, retry=False)
    assert refused.value.status == 401


def test_the_page_is_served_from_a_fixed_table_of_files(service):
    server, _ = service
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    for path, expected in (("/", b"/rl.js"), ("/rl.js", b"/v1/rl/dashboard"), ("/charts.js", b"PrimeCharts"),
                           ("/dashboard.css", b"canvas")):
        conn.request("GET", path)
        response = conn.getresponse()
        assert response.status == 200 and expected in response.read(), path
    for path in ("/../coordinator.sqlite", "/etc/passwd", "/v1/rl/dashboard"):
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        assert response.status == 404, path
