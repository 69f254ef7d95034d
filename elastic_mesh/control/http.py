"""JSON over HTTP for the services a run's members talk to besides the coordinator (the RL
orchestrator today): a small threaded server whose every request is authenticated with a run token
that the coordinator itself confirms, and size-limited.

A service holds no run secret, so it cannot check a token's signature; it asks the run's coordinator
(the address it was started with, never the one a token names) and caches the answer for
`recheck_s`, so a revoked token stops working within that time.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

from elastic_mesh.control.client import CoordinatorClient, CoordinatorError
from elastic_mesh.control.tls import accept
from elastic_mesh.control.token import JoinToken, TokenError, read_token

log = logging.getLogger(__name__)


class Refused(Exception):
    """A request refused with an HTTP status and a message that says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class TokenCheck:
    """Confirms bearer tokens with the run's coordinator; answers the token's (signed) facts.

    Work (leases, rollouts, batches) needs a token the coordinator would let take part in a broadcast
    (node or worker role, not revoked); reading (the dashboard) any token that may read the run's status,
    observer tokens included."""

    def __init__(self, coordinator: str, run_id: str, recheck_s: float = 30.0, tls_fp: str = "") -> None:
        """tls_fp: the coordinator's certificate as this process's own token names it (never a caller's)."""
        self.coordinator, self.run_id, self.recheck_s, self.tls_fp = coordinator, run_id, recheck_s, tls_fp
        self._cache: dict[tuple[str, bool], tuple[JoinToken, float]] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_token(cls, token: str, recheck_s: float = 30.0) -> "TokenCheck":
        """Checks tokens of the run, with the coordinator and certificate this process's own token names."""
        facts = read_token(token)
        return cls(facts.coordinator, facts.run_id, recheck_s, facts.tls_fp)

    def __call__(self, authorization: str, read_only: bool = False) -> JoinToken:
        if not authorization.startswith("Bearer "):
            raise Refused(401, "no token: send the run token this process was given as 'Authorization: Bearer'")
        text = authorization[7:].strip()
        with self._lock:
            cached = self._cache.get((text, read_only))
        if cached and time.monotonic() < cached[1]:
            return cached[0]
        try:
            token = read_token(text)
        except TokenError as e:
            raise Refused(403, f"malformed token: {e}") from None
        client = CoordinatorClient(self.coordinator, request_timeout_s=10, retry_s=10, bearer=text, tls_fp=self.tls_fp)
        try:
            hello = client.get_status(text) if read_only else client.post("/v1/broadcast/hello", {})
        except CoordinatorError as e:
            raise Refused(403 if e.status and e.status < 500 else 503, f"the coordinator did not confirm this token: {e}") from None
        finally:
            client.close()
        if hello.get("run_id") != self.run_id or token.run_id != self.run_id:
            raise Refused(403, f"token of run {token.run_id}, this is run {self.run_id}")
        with self._lock:
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[(text, read_only)] = (token, time.monotonic() + self.recheck_s)
        return token


Route = Callable[[JoinToken, dict], dict]


class JsonServer(ThreadingHTTPServer):
    """JSON endpoints: routes[path](token, body) -> answer; Refused -> its status. Routes in `read_only`
    accept any token that may read the run's status. GET serves `pages` (path -> (file, content type)):
    fixed files that hold no data, so no path from a request reaches the file system."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, host: str, port: int, routes: dict[str, Route], check: Callable[..., JoinToken],
                 max_request_bytes: int = 64 << 20, read_only: frozenset[str] = frozenset(),
                 pages: dict[str, tuple[Path, str]] | None = None) -> None:
        super().__init__((host, port), _Handler)
        self.routes, self.check, self.max_request_bytes = routes, check, max_request_bytes
        self.read_only, self.pages = read_only, dict(pages or {})
        self.tls: ssl.SSLContext | None = None  # set before start() where the run speaks TLS (control/tls.py)

    def get_request(self):
        conn, address = self.socket.accept()
        return accept(conn, self.tls), address

    def handle_error(self, request, client_address) -> None:  # a client that spoke no TLS, or hung up
        log.debug("request from %s failed", client_address, exc_info=True)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def start(self) -> None:
        threading.Thread(target=self.serve_forever, daemon=True, name="http-service").start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: JsonServer

    def log_message(self, fmt, *args):  # one line per request would drown the events that matter
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        page = self.server.pages.get(self.path.split("?", 1)[0].split("#", 1)[0])
        if page is None:
            return self._reply(404, {"error": f"no such page {self.path[:100]}"})
        data = page[0].read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", page[1])
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            return self._reply(400, {"error": "bad Content-Length"})
        if length < 0 or length > self.server.max_request_bytes:
            self.close_connection = True
            return self._reply(413, {"error": f"request of {length} bytes is over the limit of "
                                              f"{self.server.max_request_bytes}"})
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise ValueError("body is not a JSON object")
            route = self.server.routes.get(self.path)
            if route is None:
                return self._reply(404, {"error": f"no such endpoint {self.path[:100]}"})
            authorization = self.headers.get("Authorization", "")
            token = (self.server.check(authorization, read_only=True) if self.path in self.server.read_only
                     else self.server.check(authorization))
            self._reply(200, route(token, body))
        except Refused as e:
            self._reply(e.status, {"error": str(e)})
        except (ValueError, KeyError, TypeError) as e:
            self._reply(400, {"error": f"malformed request: {type(e).__name__}: {str(e)[:200]}"})
        except Exception as e:  # the server must outlive a bug in one request
            log.exception("request %s failed", self.path)
            self._reply(500, {"error": f"internal error: {type(e).__name__}"})
