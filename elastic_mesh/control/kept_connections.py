"""HTTP requests over kept-open TCP connections.

Over a WAN link every new connection costs a round trip before the request can even go out (160 ms
between two `global` hosts), and a new connection starts TCP's slow start again. A node asks the
coordinator several questions per round (ready, vote, commit, rendezvous keys), and a joiner
fetches a snapshot chunk by chunk, so both keep their connections open between requests.

A kept connection the server closed while it sat idle (servers here drop one after 30 s without a
request) fails on first use; that failure is not the peer's fault, so the request is sent once more
on a fresh connection. Connections idle for longer than the servers wait are not reused at all.
"""

from __future__ import annotations

import http.client
import ssl
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from elastic_mesh.control.tls import TLSError, check_service

IDLE_S = 20.0  # under the 30 s the coordinator's and snapshot servers' handlers wait for a next request


class _ServiceConnection(http.client.HTTPSConnection):
    """An HTTPS connection that ends before its first request unless the server's certificate was issued
    for `service`."""

    def __init__(self, host: str, port: int, *, timeout: float, context: ssl.SSLContext, service: str) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self.service = service

    def connect(self) -> None:
        super().connect()
        try:
            check_service(self.sock, self.service, f"{self.host}:{self.port}")
        except TLSError:
            self.close()
            raise


class KeptConnections:
    """Idle connections, per host:port, that any thread may take for one request and give back. Each
    request in flight holds its own connection, so long-polls of several threads never share one."""

    def __init__(self, timeout_s: float, tls: ssl.SSLContext | None = None, service: str | None = None) -> None:
        """tls: speak TLS, trusting what this context trusts (control/tls.py); None: plain HTTP. service: the
        service the servers' certificates must name (check_service), before a request goes out."""
        self.timeout_s, self.tls, self.service = timeout_s, tls, service
        self._idle: dict[str, list[tuple[http.client.HTTPConnection, float]]] = {}
        self._lock = threading.Lock()

    def request(self, address: str, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None, first_byte_s: float | None = None) -> tuple[int, bytes]:
        """(status, body) of one request. Raises OSError or http.client.HTTPException when it failed on a
        fresh connection; the whole body is read even on an error status, so the connection stays usable.
        first_byte_s: the connection and the answer's head must come within this (TimeoutError), where
        a peer not yet known to answer may be one that never does."""
        status, _, data = self.exchange(address, method, path, body, headers, first_byte_s)
        return status, data

    def exchange(self, address: str, method: str, path: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None,
                 first_byte_s: float | None = None) -> tuple[int, http.client.HTTPMessage, bytes]:
        """As request(), with the answer's headers: (status, headers, body)."""
        conn, response = self._send(address, method, path, body, headers, first_byte_s)
        try:
            data = response.read()
        except BaseException:
            conn.close()
            raise
        self._give_back(address, conn, response.will_close)
        return response.status, response.headers, data

    @contextmanager
    def streaming(self, address: str, method: str, path: str, headers: dict[str, str] | None = None,
                  first_byte_s: float | None = None) -> Iterator[http.client.HTTPResponse]:
        """One request whose response the caller reads as it arrives (a stream of frames). The connection
        is kept only if the caller read the body to its end (a refusal such as 204 or 503 read whole, or a
        stream to its last frame, even when the caller then raises); one left early is closed."""
        conn, response = self._send(address, method, path, None, headers, first_byte_s)
        try:
            yield response
        finally:
            if response.isclosed():
                self._give_back(address, conn, response.will_close)
            else:
                conn.close()

    def _send(self, address: str, method: str, path: str, body: bytes | None, headers: dict[str, str] | None,
              first_byte_s: float | None = None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """A connection and the response to one request on it, its head read. A kept connection that the
        server closed while it sat idle fails here, and that is not the peer's fault: the request goes once
        more on a fresh connection (the address's other idle ones most likely went the same way: closed)."""
        for attempt in range(2):
            conn, reused = self._take(address)
            limit = self.timeout_s if first_byte_s is None else min(self.timeout_s, first_byte_s)
            try:
                conn.timeout = limit  # a new connection's connect() takes it; a kept one's socket below
                if conn.sock is not None:
                    conn.sock.settimeout(limit)
                conn.request(method, path, body=body, headers=headers or {})
                response = conn.getresponse()
                if conn.sock is not None:
                    conn.sock.settimeout(self.timeout_s)  # the body: the ordinary limit between two reads
                conn.timeout = self.timeout_s
                return conn, response
            except (http.client.HTTPException, ConnectionError):
                conn.close()
                if not reused or attempt:
                    raise
                with self._lock:
                    stale = self._idle.pop(address, [])
                for old, _ in stale:
                    old.close()
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _take(self, address: str) -> tuple[http.client.HTTPConnection, bool]:
        now = time.monotonic()
        with self._lock:
            idle = self._idle.get(address, [])
            while idle:
                conn, since = idle.pop()
                if now - since < IDLE_S:
                    return conn, True
                conn.close()
        host, port = address.rsplit(":", 1)
        if self.tls is not None and self.service is not None:
            return _ServiceConnection(host, int(port), timeout=self.timeout_s, context=self.tls,
                                      service=self.service), False
        if self.tls is not None:
            return http.client.HTTPSConnection(host, int(port), timeout=self.timeout_s, context=self.tls), False
        return http.client.HTTPConnection(host, int(port), timeout=self.timeout_s), False

    def _give_back(self, address: str, conn: http.client.HTTPConnection, closing: bool) -> None:
        if closing:
            conn.close()
            return
        now = time.monotonic()
        with self._lock:
            self._idle.setdefault(address, []).append((conn, now))
            # A pool kept for long (a member's, over many downloads) meets peers that leave: close what
            # no request will take any more instead of holding their sockets for the process's life.
            expired = [(a, c) for a, kept in self._idle.items() for c, since in kept if now - since >= IDLE_S]
            for a, c in expired:
                self._idle[a] = [(k, t) for k, t in self._idle[a] if k is not c]
                if not self._idle[a]:
                    del self._idle[a]
        for _, c in expired:
            c.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn, _ in conns:
                conn.close()
