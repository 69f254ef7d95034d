"""A node's connection to the coordinator: JSON over HTTP with the node's session, retries, heartbeats.

When the join token names the coordinator's TLS certificate (tls_fp), the client speaks TLS: before
its first request it reads the certificate the coordinator presents and compares its fingerprint with
the token's (control/tls.py), then verifies every connection against it. A mismatch is never retried.

Every call has an explicit timeout. Connection failures are retried for up to `retry_s`, so a
coordinator that restarts does not bring nodes down; refusals (4xx) are raised at once. Connections
are kept open between requests (elastic_mesh/control/kept_connections.py): over a WAN a new one costs a round
trip per request.
"""

from __future__ import annotations

import http.client
import json
import logging
import ssl
import threading
import time
from collections import deque
from dataclasses import dataclass

from elastic_mesh.control.kept_connections import KeptConnections
from elastic_mesh.control.tls import TLSError, client_context, pinned_ca
from elastic_mesh.control.token import read_token

log = logging.getLogger(__name__)


class CoordinatorError(RuntimeError):
    """The coordinator refused a request (status >= 400) or could not be reached within retry_s."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def dropped(self) -> bool:
        """The coordinator no longer counts this node a member (declared dead, session unknown, token
        revoked): joining again is the way on, if the token still admits it."""
        return self.status in (401, 410)


@dataclass
class Credentials:
    address: str
    node_id: str
    session: str
    name: str


class CoordinatorClient:
    def __init__(self, address: str, request_timeout_s: float = 30.0, retry_s: float = 120.0,
                 bearer: str | None = None, tls_fp: str = "", tls: ssl.SSLContext | None = None,
                 service: str | None = None) -> None:
        """bearer: a join token sent with every request instead of a session (broadcast members).
        tls_fp: the fingerprint of the coordinator's TLS certificate ("": plain HTTP). tls: a context that
        already trusts the run's certificates, for another of the run's servers (an RL orchestrator).
        service: with tls, the service that server's certificate must have been issued for (control/tls.py):
        any other member of the run holds a certificate the run signed too."""
        self.address, self.request_timeout_s, self.retry_s = address, request_timeout_s, retry_s
        self.bearer, self.tls_fp = bearer, tls_fp
        self.credentials: Credentials | None = None
        self.tls = tls  # set once the coordinator's certificate checked out
        self.service = service
        self._connections = KeptConnections(request_timeout_s, tls, service)
        self._pin_lock = threading.Lock()

    @classmethod
    def for_token(cls, token: str, request_timeout_s: float = 30.0, retry_s: float = 120.0,
                  bearer: bool = False) -> "CoordinatorClient":
        """A client of the coordinator a join token names, over TLS when the token pins a certificate."""
        info = read_token(token)
        return cls(info.coordinator, request_timeout_s, retry_s, bearer=token if bearer else None,
                   tls_fp=info.tls_fp)

    def tls_context(self) -> ssl.SSLContext | None:
        """The context that trusts this run's certificates (None: the run speaks plain HTTP). The first call
        checks the coordinator's certificate against the token: TLSError if it is not the one."""
        if not self.tls_fp or self.tls is not None:
            return self.tls
        with self._pin_lock:
            if self.tls is None:
                self._connections = KeptConnections(self.request_timeout_s, client_context(
                    pinned_ca(self.address, self.tls_fp, self.request_timeout_s)))
                self.tls = self._connections.tls
        return self.tls

    def _session_headers(self) -> dict[str, str]:
        if not self.credentials:
            return {"Authorization": f"Bearer {self.bearer}"} if self.bearer else {}
        return {"X-Prime-Node": self.credentials.node_id, "X-Prime-Session": self.credentials.session}

    def _answer(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> dict:
        self.tls_context()
        try:
            status, data = self._connections.request(self.address, method, path, body, headers)
        except ssl.SSLCertVerificationError as e:
            raise TLSError(f"the coordinator at {self.address} presents a certificate this run's did not sign "
                           f"({e.verify_message}): someone in between?") from None
        if status >= 400:
            try:
                message = json.loads(data).get("error", f"HTTP {status}")
            except (ValueError, AttributeError):
                message = f"HTTP {status}: {data[:200].decode(errors='replace')}"
            raise CoordinatorError(message, status)
        return json.loads(data)

    def post(self, path: str, body: dict, retry: bool = True) -> dict:
        headers = {"Content-Type": "application/json", **self._session_headers()}
        data = json.dumps(body).encode()
        give_up = time.monotonic() + (self.retry_s if retry else 0)
        delay = 0.2
        while True:
            try:
                return self._answer("POST", path, data, headers)
            except TLSError as e:  # not the coordinator the token names: retrying would not change that
                raise CoordinatorError(str(e)) from None
            except CoordinatorError as e:
                # 429: this token asked faster than the service's rate; it said to come back in a second.
                if e.status != 429 or time.monotonic() + 1.0 > give_up:
                    raise
                log.warning("%s %s: %s; asking again in 1 s", self.address, path, e)
                time.sleep(1.0)
            except (http.client.HTTPException, OSError) as e:
                if time.monotonic() > give_up:
                    raise CoordinatorError(f"coordinator {self.address} unreachable for {self.retry_s:.0f} s "
                                           f"({e}); check that it runs and that this node can reach it") from None
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def get_status(self, token: str | None = None) -> dict:
        """The coordinator's /status: with a join token, or with this node's session."""
        headers = {"Authorization": f"Bearer {token}"} if token else self._session_headers()
        try:
            return self._answer("GET", "/status", None, headers)
        except TLSError as e:
            raise CoordinatorError(str(e)) from None
        except (http.client.HTTPException, OSError) as e:
            raise CoordinatorError(f"coordinator {self.address} unreachable ({e})") from None

    def close(self) -> None:
        """Closes the kept connections (a later request opens new ones)."""
        self._connections.close()

    def join(self, token: str, **node_facts) -> dict:
        answer = self.post("/v1/join", {"token": token, **node_facts})
        self.credentials = Credentials(self.address, answer["node_id"], answer["session"], answer["name"])
        return answer

    def long_poll(self, path: str, body: dict, done, timeout_s: float) -> dict:
        """Repeats a long-poll request until done(answer) or timeout_s passes."""
        give_up = time.monotonic() + timeout_s
        while True:
            answer = self.post(path, body)
            if done(answer):
                return answer
            if time.monotonic() > give_up:
                raise CoordinatorError(f"{path} got no answer within {timeout_s:.0f} s")


class TelemetryBuffer:
    """Records (flat dicts of numbers) waiting for the next heartbeat to carry them to the coordinator.

    Bounded: while the coordinator is unreachable the oldest records are dropped, never training."""

    def __init__(self, capacity: int = 2000) -> None:
        self._records: deque[dict] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def add(self, record: dict) -> None:
        with self._lock:
            self._records.append(record)

    def take(self, limit: int = 500) -> list[dict]:
        with self._lock:
            return [self._records.popleft() for _ in range(min(limit, len(self._records)))]

    def put_back(self, records: list[dict]) -> None:
        with self._lock:
            self._records.extendleft(reversed(records))


class Heartbeat:
    """Renews the node's lease in the background; remembers if the coordinator declared it dead.

    Each heartbeat also carries the telemetry recorded since the last one (for the dashboard)."""

    def __init__(self, client: CoordinatorClient, interval_s: float, telemetry: TelemetryBuffer | None = None) -> None:
        self.client, self.interval_s = client, interval_s
        self.telemetry = telemetry or TelemetryBuffer()
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="heartbeat")

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            records = self.telemetry.take()
            try:
                self.client.post("/v1/heartbeat", {"telemetry": records}, retry=False)
            except CoordinatorError as e:
                self.telemetry.put_back(records)
                if self._stop.is_set():
                    return  # a request that outlived its session (e.g. across a partition): not news
                if e.dropped:
                    self.lost = str(e)
                    log.warning("coordinator dropped this node: %s", e)
                    return
                # Unreachable: keep training and keep trying; the lease grace covers short outages.

    def stop(self) -> None:
        self._stop.set()
