"""HTTP front of the coordinator: JSON in, JSON out, every request but join authenticated (from its
headers, before its body is read); the dashboard at `/`. It stands on the hardened core
(control/service.py): connections capped per peer and in total, every request under a deadline (but
each admitted node's one lifeline, held open on purpose; a newer one replaces it), bodies size-limited,
a token's broadcast requests rate-limited. Nothing is unpickled.
"""

from __future__ import annotations

import base64
import logging
import socket
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from elastic_mesh.control.lifeline import PATH as LIFELINE
from elastic_mesh.control.lifeline import REPLACED
from elastic_mesh.control.service import BodyRefused, HardenedHandler, HardenedServer, ServiceLimits, printable
from elastic_mesh.coordinator.config import Refused
from elastic_mesh.coordinator.core import Coordinator

log = logging.getLogger(__name__)

DASHBOARD_DIR = Path(__file__).parent / "dashboard"  # also the charts and style of prime.rl's page
# Served from the package, nothing else: no path from the request ever reaches the file system.
DASHBOARD_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
    "/charts.js": ("charts.js", "text/javascript; charset=utf-8"),
}


class _Handler(HardenedHandler):
    """The hardened core's handler (control/service.py): deadlines, caps, the route and the caller
    known from the headers before a byte of the body is read."""

    server: "CoordinatorServer"

    def _reply(self, status: int, body: dict) -> None:
        self.reply(status, body)

    def do_GET(self):
        url = urlsplit(self.path)
        page = DASHBOARD_FILES.get(url.path)
        if page is not None:
            # The page itself holds no data; what it shows comes from /status and /v1/history, which check
            # the token the page sends (taken from the URL's #fragment, which never reaches a server).
            return self.send_bytes(200, (DASHBOARD_DIR / page[0]).read_bytes(), page[1])
        if url.path.rstrip("/") not in ("/status", "/v1/status", "/v1/history"):
            return self._reply(404, {"error": f"no such endpoint {printable(self.path, 100)}"})
        coordinator = self.server.coordinator
        if not coordinator.may_read_status(self.headers.get("Authorization", ""),
                                           self.headers.get("X-Prime-Node", ""),
                                           self.headers.get("X-Prime-Session", "")):
            return self._reply(401, {"error": "the status needs a join token (Authorization: Bearer TOKEN, or open "
                                              "the dashboard as http://HOST:PORT/#token=TOKEN); or start the "
                                              "coordinator with --public-status"})
        if url.path.startswith("/v1/history"):
            try:
                after = int(parse_qs(url.query).get("after", ["0"])[0])
            except ValueError:
                return self._reply(400, {"error": "after must be an integer (the last_id of the previous answer)"})
            return self._reply(200, self.server.coordinator.history(after))
        return self._reply(200, coordinator.status())

    def do_POST(self):
        coordinator = self.server.coordinator
        if self.path not in _ROUTES:
            return self._reply(404, {"error": f"no such endpoint {printable(self.path, 100)}"})
        limit = coordinator.config.max_request_bytes
        try:
            # Who asks is known from the headers before a byte of the body is read.
            if self.path == "/v1/join":
                return self._reply(200, coordinator.join(self.read_body(limit), peer=self.client_address[0]))
            if self.path.startswith(BROADCAST):
                token = coordinator.authorize(self.headers.get("Authorization", ""), "broadcast")
                if not self.server.rates.allow(token.token_id):
                    raise Refused(429, f"token {token.token_id} is over its request rate; slow down")
                body = self.read_body(limit)
                return self._reply(200, _BROADCAST_ROUTES[self.path](coordinator, token, body, self.client_address[0]))
            node = coordinator.authenticate(self.headers.get("X-Prime-Node", ""),
                                            self.headers.get("X-Prime-Session", ""))
            body = self.read_body(limit)
            if self.path == LIFELINE:
                return self._hold_lifeline(coordinator, node)
            self._reply(200, _ROUTES[self.path](coordinator, node, body))
        except Refused as e:
            self.discard_body(limit)
            if e.status in (401, 403, 429):
                self.tarpit()
            self._reply(e.status, {"error": str(e)})
        except BodyRefused as e:
            self._reply(e.status, {"error": str(e)})
        except (ValueError, KeyError, TypeError) as e:
            self._reply(400, {"error": f"malformed request: {type(e).__name__}: {printable(e)}"})

    def _hold_lifeline(self, coordinator: Coordinator, node) -> None:
        """Answers, then holds the connection until the node's end closes (control/lifeline.py)."""
        if coordinator.config.lease_only:
            return self._reply(409, {"error": "this coordinator detects deaths by lease only (--lease-only)"})
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
        self.wfile.flush()
        self.close_connection = True
        conn, lifelines = self.connection, self.server.lifelines
        self.server.guard.disarm(conn)  # held open on purpose: only its close matters
        replaced = threading.Event()
        with self.server.lifelines_lock:
            older = lifelines.get(node.node_id)
            lifelines[node.node_id] = (conn, replaced)
        if older is not None:  # one per node: a newer one replaces it (its close is not a death)
            older[1].set()
        # It carries nothing: only its close matters. Its own thread is the only one that ever reads or
        # writes it (a TLS connection must not be used by two threads at once), so a replacement is a
        # flag it looks at twice a second, and it sends "replaced" itself.
        conn.settimeout(0.5)
        while not replaced.is_set():
            try:
                if not conn.recv(4096):
                    break
            except TimeoutError:
                continue
            except OSError:
                break  # a reset is a close too
        if replaced.is_set():
            try:
                conn.sendall(REPLACED)  # its holder stops re-opening it
            except OSError:
                pass
        with self.server.lifelines_lock:
            current = lifelines.get(node.node_id, (None,))[0] is conn
            if current:
                del lifelines[node.node_id]
        if current and not self.server.stopping.is_set():  # our own stop closes them all: no deaths
            with coordinator.lock:
                coordinator.members.lifeline_closed(node.node_id, node.session_hash)


def _close(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _long_poll(coordinator: Coordinator, attempt) -> dict:
    """Calls attempt() under the lock until it answers or poll_s passes (then answers 'wait')."""
    deadline = time.monotonic() + coordinator.config.poll_s
    with coordinator.lock:
        while True:
            answer = attempt()
            if answer is not None:
                return answer
            left = deadline - time.monotonic()
            if left <= 0:
                return {"status": "wait"}
            coordinator.changed.wait(timeout=min(left, 0.5))


def _store_get(c: Coordinator, node, body) -> dict:
    key = str(body["key"])
    with c.lock:
        c.rounds.rendezvous.rank_of(node, key)
    return _long_poll(c, lambda: _found(c, key, c.state.store_get(key)))


def _found(c: Coordinator, key: str, value: bytes | None) -> dict | None:
    if value is None:
        _refuse_dead_epoch(c, key)
        return None
    return {"status": "ok", "value": base64.b64encode(value).decode()}


def _refuse_dead_epoch(c: Coordinator, key: str) -> None:
    """A rendezvous key of an aborted epoch will never appear (its member died): say so instead of
    letting Gloo wait for its own time-out."""
    epoch = key[1:].split("/", 1)[0] if key.startswith("e") else ""
    if epoch.isdigit() and c.rounds.epoch_is_dead(int(epoch)):
        raise Refused(410, f"epoch {epoch} was aborted (a member died or held it up before the rendezvous "
                           "completed)")


def _store_set(c: Coordinator, node, body) -> dict:
    key, value = str(body["key"]), base64.b64decode(body["value"], validate=True)
    with c.lock:
        if c.rounds.rendezvous.check_set(node, key, value):
            with c.state.transaction():
                c.state.store_set(key, value)
            c.changed.notify_all()
    return {"status": "ok"}


def _store_add(c: Coordinator, node, body) -> dict:
    key, amount = str(body["key"]), int(body["amount"])
    if not -(1 << 62) < amount < 1 << 62:
        raise Refused(400, "a store counter moves by less than 2**62 at a time")
    with c.lock, c.state.transaction():
        c.rounds.rendezvous.rank_of(node, key)
        current = c.state.store_get(key)
        value = (int(current.decode()) if current else 0) + amount
        c.state.store_set(key, str(value).encode())
        c.changed.notify_all()
    return {"status": "ok", "value": value}


def _store_check(c: Coordinator, node, body) -> dict:
    keys = _member_keys(c, node, body)
    with c.lock:
        return {"status": "ok", "present": all(c.state.store_get(k) is not None for k in keys)}


def _member_keys(c: Coordinator, node, body) -> list[str]:
    keys = body["keys"]
    if not isinstance(keys, list) or not 0 < len(keys) <= 64:
        raise Refused(400, "keys: a list of 1 to 64 rendezvous keys")
    keys = [str(k) for k in keys]
    with c.lock:
        for key in keys:
            c.rounds.rendezvous.rank_of(node, key)
    return keys


def _store_wait(c: Coordinator, node, body) -> dict:
    keys = _member_keys(c, node, body)

    def present() -> dict | None:
        missing = [k for k in keys if c.state.store_get(k) is None]
        for key in missing:
            _refuse_dead_epoch(c, key)
        return None if missing else {"status": "ok"}
    return _long_poll(c, present)


_ROUTES = {
    "/v1/join": None,
    LIFELINE: None,  # held open by the handler itself
    "/v1/heartbeat": lambda c, n, b: c.heartbeat(n, b),
    "/v1/leave": lambda c, n, b: c.leave(n),
    "/v1/ready": lambda c, n, b: _long_poll(c, lambda: c.rounds.declare_ready(c.state.node(n.node_id), b)),
    "/v1/present": lambda c, n, b: c.rounds.show_up(c.state.node(n.node_id), b),
    "/v1/vote": lambda c, n, b: _long_poll(c, lambda: c.rounds.vote(c.state.node(n.node_id), b)),
    "/v1/commit": lambda c, n, b: c.rounds.commit(n, b),
    "/v1/will_join": lambda c, n, b: c.rounds.will_join(n, b),
    "/v1/sources": lambda c, n, b: c.rounds.sources(n),
    "/v1/lease": lambda c, n, b: c.lease(n, b),
    "/v1/wait_commit": lambda c, n, b: _long_poll(c, lambda: c.rounds.wait_commit(n, b)),
    "/v1/store/get": _store_get,
    "/v1/store/set": _store_set,
    "/v1/store/add": _store_add,
    "/v1/store/check": _store_check,
    "/v1/store/wait": _store_wait,
}


BROADCAST = "/v1/broadcast/"
# Broadcast members authenticate with their token on every request (they hold no session): (coordinator,
# token, body, peer address) -> answer.
_BROADCAST_ROUTES = {
    BROADCAST + "hello": lambda c, t, b, p: c.broadcast_hello(t, b),
    BROADCAST + "publish": lambda c, t, b, p: c.broadcasts.publish(t, b, p),
    BROADCAST + "wait": lambda c, t, b, p: _long_poll(c, lambda: c.broadcasts.wait_answer(b)),
    BROADCAST + "manifest": lambda c, t, b, p: c.broadcasts.manifest(b),
    BROADCAST + "have": lambda c, t, b, p: c.broadcasts.have(t, b, p),
    BROADCAST + "holders": lambda c, t, b, p: c.broadcasts.holders(b),
    BROADCAST + "report": lambda c, t, b, p: c.broadcasts.report(t, b),
}
_ROUTES.update(dict.fromkeys(_BROADCAST_ROUTES))


class CoordinatorServer(HardenedServer):
    def __init__(self, host: str, port: int, coordinator: Coordinator, limits: ServiceLimits) -> None:
        super().__init__((host, port), _Handler, limits)
        self.coordinator = coordinator
        # node_id -> its lifeline connection, held open, and the flag that tells its thread it was replaced
        self.lifelines: dict[str, tuple[socket.socket, threading.Event]] = {}
        self.lifelines_lock = threading.Lock()
        self.stopping = threading.Event()
        self._ticker = threading.Thread(target=self._tick, daemon=True, name="coordinator-tick")
        self._stop = threading.Event()

    def start(self) -> None:
        self._ticker.start()
        super().start("coordinator-http")

    def _tick(self) -> None:
        while not self._stop.wait(0.25):
            try:
                self.coordinator.tick()
            except Exception:  # a failed tick must not stop lease expiry for good
                log.exception("coordinator tick failed")

    def stop(self) -> None:
        self._stop.set()
        self.stopping.set()
        super().stop()
        with self.lifelines_lock:  # the nodes re-open theirs against the next coordinator
            for conn, _ in self.lifelines.values():
                _close(conn)
