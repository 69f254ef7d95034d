"""Kept-open HTTP connections (elastic_mesh/control/kept_connections.py) against a real HTTP/1.1 server on
loopback that counts the TCP connections it accepted."""

from __future__ import annotations

import contextlib
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from elastic_mesh.control.client import CoordinatorClient
from elastic_mesh.control.kept_connections import KeptConnections
from elastic_mesh.coordinator.run import make_token


class CountingServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, idle_timeout_s: float = 30.0, wait_for: int = 0) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = idle_timeout_s

            def setup(self):
                with server.lock:
                    server.connections += 1
                super().setup()

            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path == "/together":  # answers only once `wait_for` requests are in at once
                    server.together.wait(timeout=10)
                status = 404 if self.path == "/missing" else 200
                body = f"{self.path} {status}".encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        super().__init__(("127.0.0.1", 0), Handler)
        self.lock, self.connections = threading.Lock(), 0
        self.together = threading.Barrier(wait_for) if wait_for else None
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


@contextlib.contextmanager
def served(**server_options):
    server, kept = CountingServer(**server_options), KeptConnections(timeout_s=15)
    try:
        yield server, kept
    finally:
        kept.close()
        server.close()


def test_requests_in_turn_share_one_connection_even_after_an_error_status():
    with served() as (server, kept):
        for i in range(5):
            assert kept.request(server.address, "GET", f"/{i}") == (200, f"/{i} 200".encode())
        assert kept.request(server.address, "GET", "/missing") == (404, b"/missing 404")
        assert kept.request(server.address, "GET", "/after") == (200, b"/after 200")
        assert server.connections == 1


def test_a_connection_the_server_closed_while_idle_is_replaced_without_an_error():
    with served(idle_timeout_s=0.2) as (server, kept):
        assert kept.request(server.address, "GET", "/a")[0] == 200
        time.sleep(0.6)  # the server's handler gave up on the idle connection and closed it
        assert kept.request(server.address, "GET", "/b") == (200, b"/b 200")
        assert server.connections == 2


def test_a_stream_on_a_connection_the_server_closed_while_idle_goes_out_again_and_keeps_its_fresh_one():
    with served(idle_timeout_s=0.2) as (server, kept):
        assert kept.request(server.address, "GET", "/a")[0] == 200
        time.sleep(0.6)  # the kept connection is dead now
        with kept.streaming(server.address, "GET", "/stream") as response:
            assert response.read() == b"/stream 200"  # read to its end: the connection is kept
        assert kept.request(server.address, "GET", "/after") == (200, b"/after 200")
        assert server.connections == 2
        with pytest.raises(RuntimeError):
            with kept.streaming(server.address, "GET", "/left") as response:
                raise RuntimeError("the caller stops before reading")  # unread: that connection is closed
        assert kept.request(server.address, "GET", "/again")[0] == 200 and server.connections == 3


def test_requests_in_flight_at_once_each_hold_their_own_connection():
    answers = []
    with served(wait_for=3) as (server, kept):  # no answer until three requests are in: one connection could not
        threads = [threading.Thread(target=lambda: answers.append(kept.request(server.address, "GET", "/together")))
                   for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert answers == [(200, b"/together 200")] * 3
        assert server.connections == 3
        for _ in range(6):  # the three are kept and reused, by any thread
            kept.request(server.address, "GET", "/again")
        assert server.connections == 3


def test_an_unreachable_server_raises_after_one_fresh_attempt():
    server = CountingServer()
    address = server.address
    server.close()
    with pytest.raises(ConnectionRefusedError):
        KeptConnections(timeout_s=2).request(address, "GET", "/")


def test_the_coordinator_client_keeps_one_connection_for_a_nodes_requests(tmp_path):
    """The real coordinator: a join and heartbeats in turn go over one TCP connection."""
    from elastic_mesh.coordinator.config import CoordinatorConfig
    from elastic_mesh.coordinator.run import start_coordinator

    coordinator = start_coordinator(tmp_path / "coord", config=CoordinatorConfig())
    accepted = []
    original = coordinator.RequestHandlerClass.setup

    def counting_setup(handler):
        accepted.append(handler.client_address)
        original(handler)
    coordinator.RequestHandlerClass.setup = counting_setup
    try:
        client = CoordinatorClient(f"127.0.0.1:{coordinator.port}", request_timeout_s=10, retry_s=5)
        client.join(make_token(tmp_path / "coord", 60), name="a", fingerprint="fp1", procs_per_node=1,
                    state_hash="h0", address="")
        for _ in range(4):
            client.post("/v1/heartbeat", {"telemetry": []})
        assert client.get_status()["nodes"][0]["name"] == "a"
        assert len(accepted) == 1, accepted
        client.close()
    finally:
        coordinator.RequestHandlerClass.setup = original
        coordinator.stop()


def test_a_long_kept_pool_closes_connections_no_request_will_take(monkeypatch):
    """A member keeps one pool over many downloads, and the peers it met leave: what sat idle past
    IDLE_S is closed when another connection is given back, not held for the process's life."""
    from elastic_mesh.control import kept_connections

    monkeypatch.setattr(kept_connections, "IDLE_S", 0.3)
    with served() as (gone, kept), served() as (stays, _):
        assert kept.request(gone.address, "GET", "/a")[0] == 200
        assert gone.address in kept._idle
        time.sleep(0.5)
        assert kept.request(stays.address, "GET", "/b")[0] == 200
        assert gone.address not in kept._idle and stays.address in kept._idle
