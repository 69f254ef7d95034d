"""JSON over HTTP for the services a run's members talk to besides the coordinator (the RL
orchestrator today), on the hardened core (service.py): every request authenticated with a run token
that the coordinator itself confirms, before a byte of its body is read, and size-limited per route.

A service holds no run secret, so it cannot check a token's signature; it asks the run's coordinator
(the address it was started with, never the one a token names) and caches the answer for `recheck_s`
(2 s), so a revoked or expired token (the coordinator judges expiry, on its clock) stops working within
that time. A refusal is cached as briefly, so a flood of one forged token costs one question to the
coordinator per `recheck_s`.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from elastic_mesh.control.client import CoordinatorClient, CoordinatorError
from elastic_mesh.control.service import (
    BodyRefused,
    HardenedHandler,
    HardenedServer,
    ServiceLimits,
    printable,
)
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

    def __init__(self, coordinator: str, run_id: str, recheck_s: float = 2.0, tls_fp: str = "",
                 max_cached: int = 8192) -> None:
        """tls_fp: the coordinator's certificate as this process's own token names it (never a caller's)."""
        self.coordinator, self.run_id, self.recheck_s, self.tls_fp = coordinator, run_id, recheck_s, tls_fp
        self.max_cached = max_cached
        # (token text, read_only) -> (the token's facts, or the refusal, until when)
        self._cache: dict[tuple[str, bool], tuple[JoinToken | Refused, float]] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_token(cls, token: str, recheck_s: float = 2.0) -> "TokenCheck":
        """Checks tokens of the run, with the coordinator and certificate this process's own token names."""
        facts = read_token(token)
        return cls(facts.coordinator, facts.run_id, recheck_s, facts.tls_fp)

    def __call__(self, authorization: str, read_only: bool = False) -> JoinToken:
        if not authorization.startswith("Bearer "):
            raise Refused(401, "no token: send the run token this process was given as 'Authorization: Bearer'")
        text = authorization[7:].strip()[:4096]
        with self._lock:
            cached = self._cache.get((text, read_only))
        if cached and time.monotonic() < cached[1]:
            if isinstance(cached[0], Refused):
                raise cached[0]
            return cached[0]
        try:
            token = self._confirm(text, read_only)
        except Refused as e:
            if e.status != 503:  # the coordinator's own trouble is not the token's: asked again next time
                self._remember(text, read_only, e)
            raise
        self._remember(text, read_only, token)
        return token

    def _confirm(self, text: str, read_only: bool) -> JoinToken:
        try:
            token = read_token(text)
        except TokenError as e:
            raise Refused(403, f"malformed token: {e}") from None
        if token.run_id != self.run_id:
            raise Refused(403, f"token of run {token.run_id}, this is run {self.run_id}")
        client = CoordinatorClient(self.coordinator, request_timeout_s=10, retry_s=10, bearer=text, tls_fp=self.tls_fp)
        try:
            hello = client.get_status(text) if read_only else client.post("/v1/broadcast/hello", {})
        except CoordinatorError as e:
            raise Refused(403 if e.status and e.status < 500 else 503,
                          f"the coordinator did not confirm this token: {e}") from None
        finally:
            client.close()
        if hello.get("run_id") != self.run_id:
            raise Refused(403, f"the coordinator answered for run {hello.get('run_id')}, this is run {self.run_id}")
        return token

    def _remember(self, text: str, read_only: bool, answer: JoinToken | Refused) -> None:
        with self._lock:
            if len(self._cache) >= self.max_cached:
                now = time.monotonic()
                self._cache = {k: v for k, v in self._cache.items() if v[1] > now}
                if len(self._cache) >= self.max_cached:
                    self._cache.clear()
            self._cache[(text, read_only)] = (answer, time.monotonic() + self.recheck_s)


@dataclass(frozen=True)
class Route:
    """An endpoint: handler(token, body) -> answer. max_body: the most bytes its body may have (read
    only once the token was checked). read_only: any token that may read the run's status (observer
    tokens included) may call it; otherwise a member's token."""

    handler: Callable[[JoinToken, dict], dict]
    max_body: int = 16 << 10
    read_only: bool = False


class JsonServer(HardenedServer):
    """JSON endpoints on the hardened core (service.py): routes[path] -> Route; Refused -> its status.
    Per request: the route from the path (404), the token from the headers (401/403), the token's rate
    (429), then the body under the route's limit (413). GET serves `pages` (path -> (file, content
    type)): fixed files that hold no data, so no path from a request reaches the file system."""

    def __init__(self, host: str, port: int, routes: dict[str, Route], check: Callable[..., JoinToken],
                 pages: dict[str, tuple[Path, str]] | None = None, limits: ServiceLimits | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        super().__init__((host, port), _Handler, limits or ServiceLimits(), tls)
        self.routes = {path: r if isinstance(r, Route) else Route(r) for path, r in routes.items()}
        self.check, self.pages = check, dict(pages or {})


class _Handler(HardenedHandler):
    server: JsonServer

    def do_GET(self):
        page = self.server.pages.get(self.path.split("?", 1)[0].split("#", 1)[0])
        if page is None:
            return self.reply(404, {"error": f"no such page {printable(self.path, 100)}"})
        self.send_bytes(200, page[0].read_bytes(), page[1])

    def do_POST(self):
        route = self.server.routes.get(self.path)
        if route is None:
            return self.reply(404, {"error": f"no such endpoint {printable(self.path, 100)}"})
        try:
            token = self.server.check(self.headers.get("Authorization", ""), read_only=route.read_only)
            if not self.server.rates.allow(token.token_id):
                raise Refused(429, f"token {token.token_id} is over its rate of "
                                   f"{self.server.limits.requests_per_s:g} requests a second; slow down")
            body = self.read_body(route.max_body)
            self.reply(200, route.handler(token, body))
        except Refused as e:
            self.discard_body(route.max_body)
            if e.status in (401, 403, 429):
                self.tarpit()
            self.reply(e.status, {"error": str(e)}, {"Retry-After": "1"} if e.status == 429 else None)
        except BodyRefused as e:
            self.reply(e.status, {"error": str(e)})
        except (ValueError, KeyError, TypeError) as e:
            self.reply(400, {"error": f"malformed request: {type(e).__name__}: {printable(e)}"})
        except Exception as e:  # the server must outlive a bug in one request
            log.exception("request %s failed", printable(self.path, 100))
            self.reply(500, {"error": f"internal error: {type(e).__name__}"})
