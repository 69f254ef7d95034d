"""The hardened HTTP core every endpoint of a run stands on (the coordinator, the RL orchestrator):
strangers reach all of them, so nothing here trusts a client to be quick, small or few.

- Connections are capped per peer address and in total (well under the process's descriptors, so a
  flood of idle connections can never take the ones the process itself needs); one over a cap is
  closed at once, before a thread is spent on it.
- Every connection has a deadline: a request must arrive whole (headers and body) within
  read_timeout_s, a kept connection may sit idle idle_timeout_s. A reaper thread shuts the socket of
  one past its deadline, so a client that sends a byte a second holds nothing for long.
- A handler learns who asks from the headers before it reads a byte of the body (`read_body` takes the
  route's own limit), and a token's requests are rate-limited (RateLimiter).
- What a client sent is logged only through `printable`: no newline of theirs forges a log line.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pydantic import BaseModel, ConfigDict, Field

from elastic_mesh.control.tls import accept

log = logging.getLogger(__name__)

DISCARD_MAX = 64 << 10  # the largest body of a refused request read (and dropped) to keep its connection


class ServiceLimits(BaseModel):
    """What one client may take of a service."""

    model_config = ConfigDict(extra="forbid")

    read_timeout_s: float = Field(10.0, gt=0, description="A request, once begun, must arrive whole (headers and "
                                  "body) within this.")
    idle_timeout_s: float = Field(30.0, gt=0, description="A kept connection without a request is closed after this.")
    max_connections: int = Field(512, ge=1, description="Open connections in all (the process's descriptor limit "
                                 "is 1024 by default: the rest stay the process's own).")
    max_connections_per_peer: int = Field(64, ge=1, description="Open connections from one address.")
    requests_per_s: float = Field(100.0, gt=0, description="Sustained requests a second one token may make.")
    burst: int = Field(200, ge=1, description="Requests one token may make at once before the rate holds it.")
    refusals_per_s: float = Field(20.0, gt=0, description="Refused requests (no token, a bad one, over a rate) "
                                  "answered at once per client address a second (burst twice that); the rest "
                                  "are answered after tarpit_s, so a flood costs its sender time, not this side CPU.")
    tarpit_s: float = Field(1.0, ge=0, description="How long a refusal over refusals_per_s waits before its answer.")


def printable(text: object, limit: int = 200) -> str:
    """`text` as it may go into a log line: control characters (newlines included) escaped, cut to `limit`."""
    out = str(text)[:limit].encode("unicode_escape", errors="backslashreplace").decode("ascii", errors="replace")
    return out if len(str(text)) <= limit else out + "…"


class RateLimiter:
    """A token bucket per key (a token's id): `rate` a second sustained, `burst` at once."""

    def __init__(self, rate: float, burst: int, max_keys: int = 100_000) -> None:
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, when)
        self._lock = threading.Lock()

    def allow(self, key: str) -> bool:
        now = time.monotonic()
        with self._lock:
            tokens, when = self._buckets.get(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - when) * self.rate)
            if len(self._buckets) >= self.max_keys and key not in self._buckets:
                self._buckets.clear()  # bounded: a flood of keys forgets the others' debt, never grows memory
            self._buckets[key] = (tokens - 1.0 if tokens >= 1.0 else tokens, now)
            return tokens >= 1.0


class ConnectionGuard:
    """Open connections per peer and in total, and the deadline each must meet. A reaper thread shuts
    the socket of a connection past its deadline: the thread reading it then fails and ends."""

    def __init__(self, limits: ServiceLimits) -> None:
        self.limits = limits
        self._per_peer: dict[str, int] = {}
        self._peer_of: dict[socket.socket, str] = {}
        self._deadlines: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        self.refused = 0  # connections closed at once: a cap was reached
        self.reaped = 0  # connections shut because they missed their deadline
        self._stop = threading.Event()
        threading.Thread(target=self._reap, daemon=True, name="connection-reaper").start()

    @property
    def open(self) -> int:
        return len(self._peer_of)

    def admit(self, conn: socket.socket, peer: str) -> bool:
        with self._lock:
            if len(self._peer_of) >= self.limits.max_connections or \
                    self._per_peer.get(peer, 0) >= self.limits.max_connections_per_peer:
                self.refused += 1
                return False
            self._peer_of[conn] = peer
            self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
            return True

    def release(self, conn: socket.socket) -> None:
        with self._lock:
            peer = self._peer_of.pop(conn, None)
            self._deadlines.pop(conn, None)
            if peer is None:
                return
            left = self._per_peer.get(peer, 1) - 1
            if left:
                self._per_peer[peer] = left
            else:
                self._per_peer.pop(peer, None)

    def arm(self, conn: socket.socket, seconds: float) -> None:
        """The connection must do its part (send a request, finish sending it) within `seconds`."""
        with self._lock:
            self._deadlines[conn] = time.monotonic() + seconds

    def disarm(self, conn: socket.socket) -> None:
        """No deadline while this side works (a long-poll holds the connection on purpose)."""
        with self._lock:
            self._deadlines.pop(conn, None)

    def _reap(self) -> None:
        while not self._stop.wait(0.25):
            now = time.monotonic()
            with self._lock:
                late = [conn for conn, deadline in self._deadlines.items() if deadline < now]
                for conn in late:
                    del self._deadlines[conn]
            for conn in late:
                self.reaped += 1
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # closed meanwhile

    def stop(self) -> None:
        """Ends the reaper and every admitted connection: a stopped service answers nothing more, not
        even on a connection a client kept open."""
        self._stop.set()
        with self._lock:
            open_now = list(self._peer_of)
        for conn in open_now:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class HardenedServer(ThreadingHTTPServer):
    """A threaded HTTP server that admits a connection only under the caps of `limits` (else closes it
    at once) and speaks TLS where `tls` is set (control/tls.py; the handshake is the handler's)."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], limits: ServiceLimits,
                 tls: ssl.SSLContext | None = None) -> None:
        super().__init__(address, handler)
        self.limits, self.tls = limits, tls
        self.guard = ConnectionGuard(limits)
        self.rates = RateLimiter(limits.requests_per_s, limits.burst)
        self.refusals = RateLimiter(limits.refusals_per_s, max(1, int(2 * limits.refusals_per_s)))

    def get_request(self):
        conn, address = self.socket.accept()
        return accept(conn, self.tls), address

    def process_request(self, request, client_address) -> None:
        if not self.guard.admit(request, client_address[0]):
            self.shutdown_request_socket(request)  # over a cap: no thread spent, no byte read
            return
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        """After the handler's thread is done with an admitted connection."""
        self.guard.release(request)
        self.shutdown_request_socket(request)

    @staticmethod
    def shutdown_request_socket(request) -> None:
        try:
            request.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        request.close()

    def handle_error(self, request, client_address) -> None:  # a client that hung up, spoke no TLS, or was reaped
        log.debug("request from %s failed", client_address, exc_info=True)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def start(self, name: str = "http-service") -> None:
        threading.Thread(target=self.serve_forever, daemon=True, name=name).start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        self.guard.stop()


class HardenedHandler(BaseHTTPRequestHandler):
    """Reads what a client sends under its server's deadlines; answers JSON."""

    protocol_version = "HTTP/1.1"
    # The headers and the body of an answer go out as two writes. With Nagle's algorithm the body waits
    # until the headers are acknowledged: one more round trip per answer on a kept connection.
    disable_nagle_algorithm = True
    server: HardenedServer
    body_read = False  # whether this request's body was read (else an answer closes the connection)

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.limits.idle_timeout_s)

    def handle_one_request(self) -> None:
        self.body_read = False
        limits = self.server.limits
        # Idle up to idle_timeout_s, then the whole request (line, headers) within read_timeout_s.
        self.server.guard.arm(self.connection, limits.idle_timeout_s + limits.read_timeout_s)
        super().handle_one_request()
        self.server.guard.arm(self.connection, limits.idle_timeout_s + limits.read_timeout_s)

    def log_message(self, fmt, *args):  # one line per request would drown the events that matter
        log.debug("%s %s", self.address_string(), printable(fmt % args))

    def reply(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        self.send_bytes(status, json.dumps(body).encode(), "application/json", headers)

    def send_bytes(self, status: int, data: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if not self.body_read and self.headers.get("Content-Length", "0") not in ("", "0"):
            # Answered without reading the body (refused from the headers): its bytes still sit in the
            # stream, where the next request would be read from. The connection ends with this answer.
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def read_body(self, limit: int) -> dict:
        """The request's JSON object, at most `limit` bytes, read within the server's read_timeout_s.
        Raises BodyRefused (with the status to answer) for a body too large, malformed or not an object."""
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            raise BodyRefused(400, "bad Content-Length") from None
        if length < 0 or length > limit:
            raise BodyRefused(413, f"a request of {length} bytes is over this endpoint's limit of {limit}")
        self.server.guard.arm(self.connection, self.server.limits.read_timeout_s)
        try:
            data = self.rfile.read(length) if length else b""
        finally:
            self.server.guard.disarm(self.connection)
        self.body_read = True
        if len(data) < length:
            self.close_connection = True
            raise BodyRefused(400, "the body ended before its Content-Length")
        try:
            body = json.loads(data or b"{}")
        except ValueError as e:
            raise BodyRefused(400, f"the body is not JSON: {printable(e, 120)}") from None
        if not isinstance(body, dict):
            raise BodyRefused(400, "the body is not a JSON object")
        return body


    def tarpit(self) -> None:
        """Holds the answer to a refused request a while when its address is over its refusal rate: a
        flood of forged tokens or of requests over a rate then goes at the pace of its connections (capped
        per address), not as fast as this side can refuse."""
        if not self.server.refusals.allow(self.client_address[0]):
            time.sleep(self.server.limits.tarpit_s)

    def discard_body(self, limit: int) -> None:
        """Reads and drops the body of a request refused from its headers, when it is at most `limit`
        bytes: the connection then carries the client's next request, where closing it would make every
        refused request of a flood cost this side a new connection (and a TLS handshake). A larger body
        stays unread, and the answer closes the connection."""
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            return
        if 0 < length <= min(limit, DISCARD_MAX) and not self.body_read:
            try:
                self.read_body(limit)
            except BodyRefused:
                pass  # malformed, or cut short: the answer closes the connection (body_read tells)


class BodyRefused(Exception):
    """A request body this service will not read or parse; `status` is the HTTP answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
