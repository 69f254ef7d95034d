"""The hardened HTTP core (elastic_mesh/control/service.py, http.py) as an attacker meets it: real
sockets, a real coordinator confirming tokens, no token needed for most attacks."""

from __future__ import annotations

import socket
import time

import pytest

from elastic_mesh.control.client import CoordinatorClient, CoordinatorError
from elastic_mesh.control.http import JsonServer, Refused, Route, TokenCheck
from elastic_mesh.control.service import ServiceLimits, printable
from elastic_mesh.control.token import read_token
from elastic_mesh.coordinator.run import make_token, revoke_token, start_coordinator


@pytest.fixture()
def run(tmp_path):
    coordinator = start_coordinator(tmp_path / "coord")
    worker = make_token(tmp_path / "coord", 600, role="worker")
    yield coordinator, worker, tmp_path
    coordinator.stop()


def serve(coordinator, worker, **limits) -> JsonServer:
    check = TokenCheck(f"127.0.0.1:{coordinator.port}", read_token(worker).run_id)
    routes = {"/v1/echo": Route(lambda token, body: {"token": token.token_id, "keys": sorted(body)}, max_body=1024)}
    server = JsonServer("127.0.0.1", 0, routes, check, limits=ServiceLimits(**limits))
    server.start()
    return server


def raw(server: JsonServer, request: bytes, timeout: float = 10.0) -> tuple[bytes, float]:
    """What the server answers to these bytes, and how long it took."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        s.sendall(request)
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
                if b"\r\n\r\n" in answer and b"Content-Length" in answer:
                    head, _, body = answer.partition(b"\r\n\r\n")
                    length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                    if len(body) >= length:
                        break
        except (ConnectionResetError, socket.timeout):
            pass
    return answer, time.monotonic() - started


def test_a_huge_body_is_refused_from_its_headers_before_a_byte_of_it_is_read(run):
    coordinator, worker, _ = run
    server = serve(coordinator, worker)
    try:
        huge = b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 62914560\r\n\r\n"  # 60 MB promised, none sent
        answer, took = raw(server, huge)
        assert answer.startswith(b"HTTP/1.1 401") and took < 2, (answer[:200], took)
        with_token = huge.replace(b"Host: x", b"Host: x\r\nAuthorization: Bearer " + worker.encode())
        answer, took = raw(server, with_token)
        assert answer.startswith(b"HTTP/1.1 413") and b"limit of 1024" in answer and took < 5, answer[:300]
        assert CoordinatorClient(f"127.0.0.1:{server.port}", 10, 5, bearer=worker).post("/v1/echo", {"a": 1}) == \
            {"token": read_token(worker).token_id, "keys": ["a"]}
    finally:
        server.stop()


def raw_all(server: JsonServer, request: bytes, quiet_s: float = 1.0) -> bytes:
    """Everything the server sends back for these bytes until it closes or is quiet for quiet_s."""
    answer = b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=quiet_s) as s:
        s.sendall(request)
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except (ConnectionResetError, socket.timeout):
            pass
    return answer


def test_a_refused_request_leaves_its_connection_usable_or_closes_it(run):
    """A refusal from the headers leaves the body's bytes in the stream: on a kept connection they would
    be read as the next request (a 400 the client cannot explain; a node declared dead met exactly that
    when it joined again). A small body is read and dropped, so the connection carries the next request
    (a flood of refused requests then costs no new connection, no TLS handshake, each); a body over the
    route's limit is never read, and the answer closes the connection."""
    coordinator, worker, _ = run
    server = serve(coordinator, worker)
    try:
        body = b'{"lease": "x"}'
        refused = b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        answer = raw_all(server, refused + b"POST /v1/nothing HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 401") and answer.count(b"HTTP/1.1 ") == 2, answer
        assert b"HTTP/1.1 404" in answer and b"no such endpoint /v1/nothing" in answer, answer
        over = b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n" + b" " * 2000
        answer = raw_all(server, over + b"POST /v1/nothing HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 401") and b"Connection: close" in answer, answer[:300]
        assert answer.count(b"HTTP/1.1 ") == 1, answer  # the second request was never read from the body's bytes
        client = CoordinatorClient(f"127.0.0.1:{server.port}", 10, 5, bearer="garbage")
        with pytest.raises(CoordinatorError) as refusal:
            client.post("/v1/echo", {"a": 1}, retry=False)
        assert refusal.value.status == 403
        client.bearer = worker  # the same client, its next request: answered, not a 400 from stale bytes
        assert client.post("/v1/echo", {"a": 1}, retry=False)["keys"] == ["a"]
    finally:
        server.stop()


def test_idle_connections_over_the_caps_are_closed_at_once_and_the_idle_ones_reaped(run):
    coordinator, worker, _ = run
    server = serve(coordinator, worker, max_connections=6, max_connections_per_peer=4, idle_timeout_s=1.0,
                   read_timeout_s=1.0)
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
    try:
        time.sleep(0.3)
        extra = socket.create_connection(("127.0.0.1", server.port))
        extra.settimeout(5)
        assert extra.recv(1) == b""  # over the per-peer cap: closed before a byte is read
        extra.close()
        assert server.guard.refused >= 1 and server.guard.open == 4
        time.sleep(2.5)  # idle past idle_timeout_s: closed (a read that waits that long ends the handler)
        assert server.guard.open == 0
        assert CoordinatorClient(f"127.0.0.1:{server.port}", 10, 5, bearer=worker).post("/v1/echo", {}) == \
            {"token": read_token(worker).token_id, "keys": []}
    finally:
        for s in held:
            s.close()
        server.stop()


def test_a_request_sent_a_byte_at_a_time_is_cut_off_at_its_deadline(run):
    """Each byte comes well within the socket's idle time-out: only the request's deadline stops it."""
    coordinator, worker, _ = run
    server = serve(coordinator, worker, idle_timeout_s=0.5, read_timeout_s=1.0)
    try:
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            try:
                for byte in b"POST /v1/echo HTTP/1.1\r\nHost: a-very-slow-client\r\n":
                    s.send(bytes([byte]))
                    time.sleep(0.1)
            except OSError:
                pass  # the server shut the connection
            cut = time.monotonic() - started
        assert cut < 3.0, cut  # 50 bytes at 0.1 s would take 5 s
        assert server.guard.reaped == 1
    finally:
        server.stop()


def test_a_tokens_rate_is_bounded(run):
    coordinator, worker, _ = run
    server = serve(coordinator, worker, requests_per_s=1.0, burst=5)
    client = CoordinatorClient(f"127.0.0.1:{server.port}", 10, 5, bearer=worker)
    try:
        statuses = []
        for _ in range(8):
            try:
                client.post("/v1/echo", {}, retry=False)
                statuses.append(200)
            except CoordinatorError as e:
                statuses.append(e.status)
        assert statuses[:5] == [200] * 5 and 429 in statuses[5:], statuses
        # A client that may retry is told 429 and comes back after the second the server asked for.
        asked = time.monotonic()
        assert client.post("/v1/echo", {"again": 1})["keys"] == ["again"]
        assert time.monotonic() - asked >= 0.9
    finally:
        server.stop()


def test_a_revoked_token_is_refused_within_two_seconds(run):
    coordinator, worker, tmp_path = run
    server = serve(coordinator, worker)
    client = CoordinatorClient(f"127.0.0.1:{server.port}", 10, 5, bearer=worker)
    try:
        client.post("/v1/echo", {})
        revoke_token(tmp_path / "coord", read_token(worker).token_id)
        revoked = time.monotonic()
        while True:
            try:
                client.post("/v1/echo", {}, retry=False)
            except CoordinatorError as e:
                assert e.status == 403
                break
            assert time.monotonic() - revoked < 2.5, "a revoked token still served"
            time.sleep(0.1)
    finally:
        server.stop()


def test_a_flood_of_one_forged_token_asks_the_coordinator_once_per_recheck(run, monkeypatch):
    coordinator, worker, _ = run
    check = TokenCheck(f"127.0.0.1:{coordinator.port}", read_token(worker).run_id, recheck_s=2.0)
    asked = []
    real = check._confirm

    def counting(text, read_only):
        asked.append(text)
        return real(text, read_only)
    monkeypatch.setattr(check, "_confirm", counting)
    forged = "Bearer " + worker[:-3] + ("AAA" if not worker.endswith("AAA") else "BBB")
    for _ in range(50):
        with pytest.raises(Refused):
            check(forged)
    assert len(asked) == 1


def test_refusals_over_an_addresss_rate_are_answered_late(run):
    """A forged-token flood from one address: the first 2 x refusals_per_s are answered at once, the rest
    after tarpit_s, so the flood goes at the pace of its connections; a valid token beside it is not held."""
    coordinator, worker, _ = run
    server = serve(coordinator, worker, refusals_per_s=5.0, tarpit_s=0.5)
    forged = CoordinatorClient(f"127.0.0.1:{server.port}", 10, 5, bearer=worker[:-3] + "AAA")
    honest = CoordinatorClient(f"127.0.0.1:{server.port}", 10, 5, bearer=worker)
    try:
        took = []
        for _ in range(14):
            started = time.monotonic()
            with pytest.raises(CoordinatorError):
                forged.post("/v1/echo", {}, retry=False)
            took.append(time.monotonic() - started)
        assert max(took[:8]) < 0.4 and any(t >= 0.45 for t in took[10:]), took  # 10 at once, then held
        started = time.monotonic()
        assert honest.post("/v1/echo", {"a": 1}, retry=False)["keys"] == ["a"]
        assert time.monotonic() - started < 0.4
    finally:
        server.stop()


def test_what_a_client_sent_cannot_forge_a_log_line():
    assert printable("give back\n12:00:00 [orchestrator] worker w2 evicted") == \
        "give back\\n12:00:00 [orchestrator] worker w2 evicted"
    assert printable("x" * 300, 10) == "x" * 10 + "…"


def test_the_coordinator_stands_on_the_same_core(tmp_path):
    """A stranger's 60 MB promise to a node route is refused from its headers; connections over the
    coordinator's per-peer cap are closed at once; a node's own requests go on."""
    from elastic_mesh.coordinator.config import CoordinatorConfig

    coordinator = start_coordinator(tmp_path / "coord", config=CoordinatorConfig(
        service=ServiceLimits(max_connections_per_peer=6, max_connections=8)))
    try:
        huge = b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Length: 62914560\r\n\r\n"
        answer, took = raw(coordinator, huge)
        assert answer.startswith(b"HTTP/1.1 401") and took < 2, (answer[:200], took)
        held = [socket.create_connection(("127.0.0.1", coordinator.port)) for _ in range(6)]
        time.sleep(0.3)
        extra = socket.create_connection(("127.0.0.1", coordinator.port))
        extra.settimeout(5)
        assert extra.recv(1) == b"" and coordinator.guard.refused >= 1
        for s in held:
            s.close()
        extra.close()
        time.sleep(0.5)
        status = CoordinatorClient(f"127.0.0.1:{coordinator.port}", 10, 5).get_status(
            make_token(tmp_path / "coord", 600, role="observer"))
        assert "run_id" in status
    finally:
        coordinator.stop()
