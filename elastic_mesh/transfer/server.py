"""Serves chunked versions over HTTP to whoever holds the run's transfer key.

GET /v1/<kind>/<version|latest> answers the manifest, GET /v1/<kind>/<version>/chunk/<i> one chunk's
bytes. The caller names the kinds it serves and how many versions of each it keeps; a version that
someone fetched from recently is kept a while longer, so a download over a slow link that outlasts a
few rounds still completes.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from elastic_mesh.transfer.chunks import Chunked, Deferred

log = logging.getLogger(__name__)

KEY_HEADER = "X-Mesh-Transfer-Key"


class _Handler(BaseHTTPRequestHandler):
    server: "ChunkServer"
    timeout = 30
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as two writes: see coordinator/server.py

    def log_message(self, fmt, *args):
        log.debug("%s %s", self.address_string(), fmt % args)

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._send(status, json.dumps({"error": message}).encode())

    def do_GET(self):
        if not hmac.compare_digest(self.headers.get(KEY_HEADER, ""), self.server.key):
            return self._error(401, "a transfer key is needed (given to members the coordinator admitted)")
        parts = self.path.strip("/").split("/")  # v1/<kind>/<latest|version>[/chunk/<i>]
        if len(parts) < 3 or parts[0] != "v1" or parts[1] not in self.server.keep:
            return self._error(404, f"no such endpoint {self.path[:100]}")
        item = self.server.get(parts[1], parts[2])
        if item is None:
            return self._error(404, f"no {parts[1]} {parts[2][:20]} here (held: {self.server.versions(parts[1])})")
        if len(parts) == 3:
            return self._send(200, json.dumps(item.manifest).encode())
        if len(parts) == 5 and parts[3] == "chunk" and parts[4].isdigit() and \
                int(parts[4]) < len(item.manifest["chunks"]):
            if self.server.before_chunk is not None:
                self.server.before_chunk(parts[1], item.version, int(parts[4]))
            return self._send(200, item.chunk(int(parts[4])), "application/octet-stream")
        return self._error(404, f"no such chunk {self.path[:100]}")


class ChunkServer(ThreadingHTTPServer):
    """Serves this process's newest versions of each kind it was given. `before_chunk(kind, version,
    index)`, when set, runs before each chunk is sent: the seam for a fault hook (a slow uplink)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, port: int, key: str, keep: dict[str, int], pin_s: float = 60.0) -> None:
        """keep: kind -> how many versions of it are held. An older version is also held while someone
        fetched from it in the last pin_s seconds."""
        if not keep or any(n < 1 for n in keep.values()):
            raise ValueError(f"keep {keep} must name at least one kind, each keeping at least 1 version")
        super().__init__((host, port), _Handler)
        self.key, self.pin_s, self.keep = key, pin_s, dict(keep)
        self.before_chunk: Callable[[str, int, int], None] | None = None
        self._last_read: dict[tuple[str, int], float] = {}
        self._held: dict[str, dict[int, Chunked | Deferred]] = {kind: {} for kind in keep}
        self._lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True, name="chunk-server").start()

    @property
    def port(self) -> int:
        return self.server_address[1]

    def handle_error(self, request, client_address) -> None:
        # A fetcher that died or gave up mid-chunk is routine here, not worth a traceback on stderr.
        log.debug("transfer request from %s ended early", client_address, exc_info=True)

    def publish(self, item: Chunked | Deferred, kind: str) -> None:
        if kind not in self._held:
            raise ValueError(f"this server serves {sorted(self._held)}, not {kind!r}")
        with self._lock:
            held = self._held[kind]
            held[item.version] = item
            now = time.monotonic()
            for old in sorted(held)[:-self.keep[kind]]:
                if now - self._last_read.get((kind, old), -math.inf) > self.pin_s:
                    del held[old]
                    self._last_read.pop((kind, old), None)

    def get(self, kind: str, which: str) -> Chunked | None:
        with self._lock:
            held = self._held[kind]
            if which == "latest":
                found = held[max(held)] if held else None
            else:
                found = held.get(int(which)) if which.isdigit() else None
            if found is not None:
                self._last_read[(kind, found.version)] = time.monotonic()
        # A deferred one is laid out outside the server's lock: other requests go on meanwhile.
        return found.get() if isinstance(found, Deferred) else found

    def versions(self, kind: str) -> list[int]:
        with self._lock:
            return sorted(self._held[kind])

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
