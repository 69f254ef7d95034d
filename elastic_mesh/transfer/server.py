"""Serves chunked versions over HTTP to whoever holds the run's transfer key.

GET /v1/<kind>/<version|latest> answers the manifest, GET /v1/<kind>/<version>/chunk/<i> one chunk's
bytes, GET /v1/<kind>/<version>/fresh/<bitmap> whichever wanted chunk it has sent least (8 bytes of
index, then the chunk); with ?wait_ms=N a relay that holds none of them yet answers the first that it
verifies within N ms (204 if none): a follower's standing request, so a chunk goes on from a relay the
moment it arrives, without the round trips of learning who holds it. With ?only_new=1 (asked by a
follower whose peers are fetching too) it sends only a chunk it has not sent in the last
`resend_after_s`, else 204: each chunk leaves a seeder once, and the followers pass it on. The caller names the kinds it serves and how many versions of each it keeps; a version that
someone fetched from recently is kept a while longer, so a download over a slow link that outlasts a
few rounds still completes. What it serves is a version laid out in memory (Chunked, Deferred) or the
verified chunks on disk of a version still being fetched (ChunkDir): a relay serves each chunk as soon
as it holds it, and answers 404 for the ones it does not hold yet.
"""

from __future__ import annotations

import base64
import fcntl
import hmac
import json
import logging
import math
import random
import socket
import struct
import termios
import threading
import time
from typing import Callable
from urllib.parse import parse_qs, urlsplit

from elastic_mesh.control.service import HardenedHandler, HardenedServer, ServiceLimits
from elastic_mesh.control.tls import accept
from elastic_mesh.transfer.chunk_dir import ChunkDir, bitmap_has
from elastic_mesh.transfer.chunks import Chunked, Deferred
from elastic_mesh.transfer.evidence import CREDENTIAL_HEADER, SIGNATURE_HEADER, ChunkSigner, sha256_hex

log = logging.getLogger(__name__)

KEY_HEADER = "X-Mesh-Transfer-Key"
TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", 13)  # Linux's value
TCP_INFO = getattr(socket, "TCP_INFO", None)  # its first byte is the connection's state
TCP_ESTABLISHED = 1
# A streamed chunk's frame: its index, its size and its signature's size (0: the server signs nothing),
# then the signature (evidence.py), then the chunk's bytes.
FRAME_HEAD = struct.Struct(">qqH")


class _Handler(HardenedHandler):
    """The hardened core's handler (control/service.py: the request must arrive within its deadlines,
    what a client sent is logged escaped); an answer, once begun, runs on the socket's own time-out."""

    server: "ChunkServer"
    timeout = 30

    def _send(self, status: int, body: bytes, content_type: str = "application/json",
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._send(status, json.dumps({"error": message}).encode())

    def do_GET(self):
        # The request is in: no deadline while this side answers (a standing request waits up to
        # MAX_WAIT_S, a stream lasts as long as its chunks take; each write has the socket's time-out).
        self.server.guard.disarm(self.connection)
        if not hmac.compare_digest(self.headers.get(KEY_HEADER, ""), self.server.key):
            return self._error(401, "a transfer key is needed (given to members the coordinator admitted)")
        url = urlsplit(self.path)
        parts = url.path.strip("/").split("/")  # v1/<kind>/<latest|version>[/chunk/<i>]
        if len(parts) < 3 or parts[0] != "v1" or parts[1] not in self.server.keep:
            return self._error(404, f"no such endpoint {self.path[:100]}")
        item = self.server.get(parts[1], parts[2])
        if item is None and len(parts) == 5 and parts[3] == "fresh" and parts[2].isdigit() and \
                (wait_s := _wait_of(url.query)):
            # A standing request for a version this member has not started to fetch yet (its peer guessed
            # that it would, as it fetched the last one): it may in a moment.
            item = self.server.wait_for(parts[1], int(parts[2]), wait_s)
        if item is None:
            return self._error(404, f"no {parts[1]} {parts[2][:20]} here (held: {self.server.versions(parts[1])})")
        if len(parts) == 3:
            return self._send(200, json.dumps(item.manifest).encode())
        if len(parts) == 5 and parts[3] == "chunk" and parts[4].isdigit() and \
                int(parts[4]) < len(item.manifest["chunks"]):
            index = int(parts[4])
            if self.server.before_chunk is not None:
                self.server.before_chunk(parts[1], item.version, index)
            if not self.server.take_upload_slot():
                return self._error(503, "busy: every upload slot is taken; ask another source or again shortly")
            try:
                return self._send_chunk(parts[1], item, index)
            finally:
                self.server.release_upload_slot()
        if len(parts) == 5 and parts[3] == "fresh":
            # Super-seeding: "any chunk of these that you have sent least": the seeder, not its
            # requesters, spreads its chunks, so members that ask at once get different ones to pass on.
            try:
                wanted = base64.urlsafe_b64decode(parts[4] + "=" * (-len(parts[4]) % 4))
            except ValueError:
                return self._error(400, "fresh/<bitmap>: the wanted chunks as an url-safe base64 bitmap")
            wait_s = _wait_of(url.query)
            query = parse_qs(url.query)
            only_new, relayed = query.get("only_new") == ["1"], query.get("relayed") == ["1"]
            # Waits without an upload slot: a standing request takes one only once it has a chunk to send.
            if wait_s and isinstance(item, ChunkDir) and not item.wait_for_any(wanted, wait_s):
                return self._send(204, b"")
            if query.get("stream") == ["1"]:
                return self._stream(parts[1], item, wanted, wait_s, only_new, relayed)
            if not self.server.take_upload_slot():
                return self._error(503, "busy: every upload slot is taken; ask another source or again shortly")
            try:
                index = self.server.least_sent(parts[1], item, wanted, only_new, requester=self.client_address[0],
                                               relayed=relayed)
                if index is None and not self.server.holds_any(item, wanted):
                    return self._error(404, f"none of the wanted chunks of {parts[1]} {item.version} is held here")
                if index is None:  # each went out a moment ago (to the swarm, or to this requester)
                    return self._send(204, b"")
                if self.server.before_chunk is not None:
                    self.server.before_chunk(parts[1], item.version, index)
                return self._send_chunk(parts[1], item, index, prefix=struct.pack(">q", index))
            finally:
                self.server.release_upload_slot()
        return self._error(404, f"no such chunk {self.path[:100]}")

    def _stream(self, kind: str, item: "Chunked | ChunkDir", wanted: bytes, wait_s: float, only_new: bool,
                relayed: bool) -> None:
        """One response that carries every wanted chunk this server has (or, waiting up to wait_s between
        two, comes to have) to send, each as a frame (index and size, 8 bytes each, then the bytes) the
        moment it is chosen: a relay's chunks flow on as it verifies them, without a request and its round
        trip per chunk. Chunked transfer encoding, so the connection stays open for the next request. Ends
        when every wanted chunk went out on it, or nothing more came to send within wait_s."""
        sent: set[int] = set()
        started = False
        requester = self.client_address[0]
        share = self.server.share_of(kind, item, requester) if only_new else None
        while share is None or len(sent) < share:
            arrived = len(item.held()) if isinstance(item, ChunkDir) else 0
            index = self.server.least_sent(kind, item, wanted, only_new, requester=requester, relayed=relayed,
                                           exclude=sent)
            if index is None:
                left = [i for i in range(len(item.manifest["chunks"])) if bitmap_has(wanted, i) and i not in sent]
                if left and wait_s and isinstance(item, ChunkDir) and not item.complete and \
                        item.wait_for_more(arrived, wait_s):
                    continue
                break
            if not self.server.take_upload_slot(give_up_s=self.timeout):
                break
            # One frame at a time over all streams: each goes out at the full uplink, so the member it goes
            # to holds a whole chunk to pass on after a chunk's time, not after one per stream sharing it.
            # Only while its bytes leave: a reader that stops taking them (a process starved of CPU, its
            # window closed) would hold every other stream of this server at its pace, so a frame that
            # stops draining gives the lock up and this stream alone waits for its reader.
            self.server.frame_lock.acquire()
            try:
                if self.server.before_chunk is not None:
                    self.server.before_chunk(kind, item.version, index)
                data = item.chunk(index)
                if self.server.chunk_filter is not None:
                    data = self.server.chunk_filter(kind, item.version, index, data)
                if not started:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/octet-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    if self.server.signer is not None:
                        self.send_header(CREDENTIAL_HEADER, self.server.signer.credential_header)
                    self.end_headers()
                    started = True
                signature = self.server.signature(kind, item, index, data)
                frame = FRAME_HEAD.pack(index, len(data), len(signature)) + signature + bytes(data)
                self.wfile.write(b"%x\r\n" % len(frame) + frame + b"\r\n")
                self.server.count_served(kind, item.version, len(data))
                sent.add(index)
                drained = _wait_until_sent(self.connection, low_water=16 << 10, give_up_s=self.timeout,
                                           unsent_only=True, stall_s=FRAME_STALL_S)
            finally:
                self.server.frame_lock.release()
                self.server.release_upload_slot()
            if not drained:
                _wait_until_sent(self.connection, low_water=16 << 10, give_up_s=self.timeout, unsent_only=True)
        if started:
            self.wfile.write(b"0\r\n\r\n")
        elif self.server.holds_any(item, wanted):
            self._send(204, b"")  # each went out a moment ago (to the swarm, or to this requester)
        else:
            self._error(404, f"none of the wanted chunks of {kind} {item.version} is held here")

    def _send_chunk(self, kind: str, item: "Chunked | ChunkDir", index: int, prefix: bytes = b"") -> None:
        data = item.chunk(index)
        if data is None:
            return self._error(404, f"chunk {index} of {kind} {item.version} is not held here yet")
        if self.server.chunk_filter is not None:
            data = self.server.chunk_filter(kind, item.version, index, data)
        self.server.count_served(kind, item.version, len(data))
        signer = self.server.signer
        headers = {} if signer is None else {
            SIGNATURE_HEADER: self.server.signature(kind, item, index, data).hex(),
            CREDENTIAL_HEADER: signer.credential_header}
        self._send(200, prefix + data if prefix else data, "application/octet-stream", headers)
        if self.server.upload_slots:
            _wait_until_sent(self.connection, low_water=64 << 10, give_up_s=self.timeout)


MAX_WAIT_S = 5.0  # longest a standing request is held here
# What one peer address may take of a chunk server: a member's download keeps a few connections to each
# source (streams, standing requests); many members behind one address (a NAT, or loopback in tests and
# benchmarks) share its cap. No token rate: requests carry the run's transfer key, not a token.
CHUNK_SERVER_LIMITS = ServiceLimits(max_connections=512, max_connections_per_peer=64, read_timeout_s=10.0,
                                    idle_timeout_s=30.0)


def _wait_of(query: str) -> float:
    """The ?wait_ms= of a fresh request in seconds (0: none or malformed), at most MAX_WAIT_S."""
    try:
        return min(MAX_WAIT_S, max(0.0, int(parse_qs(query).get("wait_ms", ["0"])[0]) / 1000))
    except ValueError:
        return 0.0


def _prefer_bbr(sock) -> None:
    """Sends this connection's chunks under BBR where the kernel has it. A fetcher keeps its connection
    between versions, and under the default congestion control a connection idle for longer than its
    retransmission time-out starts slow again (net.ipv4.tcp_slow_start_after_idle, on by default):
    every new version would crawl up from ten segments per round trip over a long link. The kernel
    exempts congestion controls with their own model from that restart, and BBR is one. Without it
    (not built, or not allowed to this user) the kernel's default stays: slower, not wrong."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, b"bbr")
    except OSError:
        pass


SIOCOUTQNSD = 0x894B  # Linux: the bytes of a TCP socket not sent yet (TIOCOUTQ counts unacknowledged ones too)


# A frame whose unsent bytes have not shrunk for this long is waiting on its reader, not on the uplink: at
# 50 Mbit/s 16 KiB leave in 2.6 ms, at 5 Mbit/s in 26 ms, and a window closed by a reader starved of CPU
# (2 cores, 7 processes: the RL benchmark) stays closed for tens to hundreds of milliseconds.
FRAME_STALL_S = 0.03


def _wait_until_sent(conn, low_water: int, give_up_s: float, unsent_only: bool = False,
                     stall_s: float | None = None) -> bool:
    """Returns once at most `low_water` bytes of this connection wait in the kernel (unsent or unacknowledged;
    unsent_only: not sent yet). A write returns when the bytes are in the send buffer (megabytes,
    autotuned), long before they are on the wire: an upload slot released then would limit nothing.
    Unacknowledged bytes are a round trip's worth at full rate, so waiting for those to drain leaves the
    link idle for a round trip per chunk: a stream, which goes on with its next frame, waits only for
    the unsent ones. stall_s: give up sooner, returning False, when the count has not shrunk for that
    long (the reader takes nothing); True otherwise."""
    request = SIOCOUTQNSD if unsent_only else getattr(termios, "TIOCOUTQ", None)
    if request is None:  # no way to ask on this platform: the slot then limits requests, not bytes
        return True
    now = time.monotonic()
    deadline, least, shrunk_at = now + give_up_s, None, now
    delay = 0.002
    while now < deadline:
        try:
            queued = struct.unpack("i", fcntl.ioctl(conn.fileno(), request, b"\0" * 4))[0]
            state = conn.getsockopt(socket.IPPROTO_TCP, TCP_INFO, 1)[0] if TCP_INFO else TCP_ESTABLISHED
        except OSError:  # not Linux, or the connection closed: nothing to wait for
            return True
        # A peer that died (a reset) leaves the unsent count where it was: waiting on it held an upload slot,
        # and a stream's frame lock with it, for give_up_s (every other stream stalled past its readers'
        # timeouts when a relay was SIGKILLed mid-transfer).
        if queued <= low_water or state != TCP_ESTABLISHED:
            return True
        if least is None or queued < least:
            least, shrunk_at = queued, now
        elif stall_s is not None and now - shrunk_at >= stall_s:
            return False
        time.sleep(delay)
        delay = min(delay * 1.5, 0.005 if unsent_only else 0.02)
        now = time.monotonic()
    return True


class ChunkServer(HardenedServer):
    """Serves this process's newest versions of each kind it was given, on the hardened core: connections
    capped per peer address and in total, a deadline for every request (CHUNK_SERVER_LIMITS). Two seams
    for fault hooks, unset in production: `before_chunk(kind, version, index)` runs before each chunk is
    sent (a slow uplink); `chunk_filter(kind, version, index, data)` returns the bytes to send (a relay
    that lies)."""

    def __init__(self, host: str, port: int, key: str, keep: dict[str, int], pin_s: float = 60.0,
                 upload_slots: int | None = None, resend_after_s: float = 1.0,
                 limits: ServiceLimits | None = None) -> None:
        """keep: kind -> how many versions of it are held. An older version is also held while someone
        fetched from it in the last pin_s seconds. upload_slots: chunks sent at once; a request beyond
        them is answered 503 at once. A seeder that sends to everyone at once shares its uplink so thinly
        that nobody holds a whole chunk for a long time, and nobody can pass one on; with a few slots
        each chunk goes out at full rate to a few members, who then serve it too. resend_after_s: how
        long a chunk sent once counts as on its way through the swarm for an only_new request (after
        that it goes out again: the member it went to may be gone)."""
        if not keep or any(n < 1 for n in keep.values()):
            raise ValueError(f"keep {keep} must name at least one kind, each keeping at least 1 version")
        # tls: set once the coordinator certified this member's key (control/tls.py); from then on every new
        # connection speaks TLS. Until the run's members learn this server's address there are none.
        super().__init__((host, port), _Handler, limits or CHUNK_SERVER_LIMITS)
        self.key, self.pin_s, self.keep = key, pin_s, dict(keep)
        self.before_chunk: Callable[[str, int, int], None] | None = None
        self.chunk_filter: Callable[[str, int, int, bytes], bytes] | None = None
        # Set once the coordinator credentialed this member's chunk key (evidence.py): from then on every
        # chunk sent carries this server's signed statement of what it is.
        self.signer: ChunkSigner | None = None
        self.served: dict[tuple[str, int], int] = {}  # (kind, version) -> bytes served
        self.upload_slots = upload_slots
        self._sent: dict[tuple[str, int], dict[int, int]] = {}  # (kind, version) -> chunk -> times chosen
        self._sent_at: dict[tuple[str, int], dict[int, float]] = {}  # (kind, version) -> chunk -> last chosen
        # (kind, version) -> requester's address -> chunk -> last chosen for it
        self._sent_to: dict[tuple[str, int], dict[str, dict[int, float]]] = {}
        self.resend_after_s = resend_after_s
        self._slots = threading.BoundedSemaphore(upload_slots) if upload_slots else None
        self._askers: dict[tuple[str, int], set[str]] = {}  # (kind, version) -> who streamed from it (share_of)
        self.frame_lock = threading.Lock()  # streamed frames go out one at a time (_Handler._stream)
        self.slot_wait_s = 0.3
        self._last_read: dict[tuple[str, int], float] = {}
        self._held: dict[str, dict[int, Chunked | Deferred]] = {kind: {} for kind in keep}
        self._lock = threading.Lock()
        self._published = threading.Condition(self._lock)  # a version was added (wait_for)
        threading.Thread(target=self.serve_forever, daemon=True, name="chunk-server").start()

    def get_request(self):
        conn, address = self.socket.accept()
        _prefer_bbr(conn)
        return accept(conn, self.tls), address

    def signature(self, kind: str, item: "Chunked | ChunkDir", index: int, data: bytes) -> bytes:
        """This server's signature of chunk `index` as `data` (b"" when it signs nothing). The manifest's
        hash where this server holds exactly those bytes (made or verified them), else the bytes' own: a
        chunk_filter (a fault hook: a relay that lies) signs what it sends, as a liar's server would."""
        if self.signer is None:
            return b""
        expected = getattr(item, "expected", None)
        if self.chunk_filter is None and (expected is None or len(expected[index]) == 1):
            digest = item.manifest["chunks"][index]["sha256"]
        else:
            digest = sha256_hex(data)
        return self.signer.sign(kind, item.version, index, digest)

    def take_upload_slot(self, give_up_s: float | None = None) -> bool:
        """Waits a moment for a slot (slot_wait_s, or give_up_s): a request queued here starts the instant
        an upload ends, where one turned away would leave the uplink idle for a round trip and a back-off.
        A stream already answering waits longer: its requester has nothing to retry."""
        return self._slots is None or self._slots.acquire(timeout=give_up_s or self.slot_wait_s)

    def release_upload_slot(self) -> None:
        if self._slots is not None:
            self._slots.release()

    @staticmethod
    def _held_and_wanted(item: "Chunked | ChunkDir", wanted: bytes, relayed: bool = False) -> list[int]:
        """relayed: only the chunks this member took from a seeder (it is the swarm's relay for those; every
        follower streams each relay's share from it, so a chunk crosses each follower's link about once)."""
        held = (item.seeded() if relayed else item.held()) if isinstance(item, ChunkDir) else None
        return [i for i in range(len(item.manifest["chunks"])) if bitmap_has(wanted, i) and (held is None or i in held)]

    def holds_any(self, item: "Chunked | ChunkDir", wanted: bytes) -> bool:
        return bool(self._held_and_wanted(item, wanted))

    def least_sent(self, kind: str, item: "Chunked | ChunkDir", wanted: bytes, only_new: bool = False,
                   requester: str | None = None, relayed: bool = False, exclude: set[int] = frozenset()) -> int | None:
        """Among the wanted chunks this server holds, one it has sent least often (counted as chosen);
        None if there is none to send now. only_new: none chosen for anyone within the last
        resend_after_s. requester (its address): none chosen for it within resend_after_s either, as
        its other streams ask with the same bitmap at the same moment and would get the same chunk twice.
        relayed: only chunks this member took from a seeder. exclude: chunks already sent on this stream."""
        choices = [i for i in self._held_and_wanted(item, wanted, relayed) if i not in exclude]
        if not choices:
            return None
        now = time.monotonic()
        with self._lock:
            counts = self._sent.setdefault((kind, item.version), {})
            chosen_at = self._sent_at.setdefault((kind, item.version), {})
            recent = self._sent_to.setdefault((kind, item.version), {}).setdefault(requester, {}) \
                if requester is not None else {}
            choices = [i for i in choices if now - recent.get(i, -math.inf) >= self.resend_after_s]
            if only_new:
                choices = [i for i in choices if now - chosen_at.get(i, -math.inf) >= self.resend_after_s]
            if not choices:
                return None
            fewest = min(counts.get(i, 0) for i in choices)
            index = random.choice([i for i in choices if counts.get(i, 0) == fewest])
            counts[index] = counts.get(index, 0) + 1
            chosen_at[index] = now
            if requester is not None:
                recent[index] = now
        return index

    def share_of(self, kind: str, item: "Chunked | ChunkDir", requester: str) -> int:
        """How many chunks one streamed answer of a seeder carries: its version split among as many
        requesters as asked for the previous version (at least one), so the first to ask does not take
        everything and then have to relay it all alone. A requester that wants more asks again."""
        with self._lock:
            self._askers.setdefault((kind, item.version), set()).add(requester)
            before = max((len(who) for (k, v), who in self._askers.items() if k == kind and v < item.version), default=1)
        return max(1, math.ceil(len(item.manifest["chunks"]) / max(1, before)))

    def count_served(self, kind: str, version: int, nbytes: int) -> None:
        with self._lock:
            self.served[(kind, version)] = self.served.get((kind, version), 0) + nbytes

    def forget(self, kind: str, version: int) -> None:
        with self._lock:
            self._held[kind].pop(version, None)
            self._last_read.pop((kind, version), None)
            self._sent.pop((kind, version), None)
            self._sent_at.pop((kind, version), None)
            self._sent_to.pop((kind, version), None)
            self._askers.pop((kind, version), None)

    def publish(self, item: Chunked | Deferred | ChunkDir, kind: str) -> None:
        if kind not in self._held:
            raise ValueError(f"this server serves {sorted(self._held)}, not {kind!r}")
        with self._lock:
            held = self._held[kind]
            held[item.version] = item
            self._published.notify_all()
            now = time.monotonic()
            for old in sorted(held)[:-self.keep[kind]]:
                if now - self._last_read.get((kind, old), -math.inf) > self.pin_s:
                    del held[old]
                    self._last_read.pop((kind, old), None)

    def wait_for(self, kind: str, version: int, timeout_s: float) -> Chunked | ChunkDir | None:
        """The version once this server holds it, waiting up to timeout_s; None at once if a newer one
        is held (this one will not come) or if it does not come in time."""
        deadline = time.monotonic() + timeout_s
        with self._published:
            while version not in self._held[kind]:
                left = deadline - time.monotonic()
                if left <= 0 or any(v > version for v in self._held[kind]):
                    return None
                self._published.wait(left)
        return self.get(kind, str(version))

    def get(self, kind: str, which: str) -> Chunked | ChunkDir | None:
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
        super().stop()
