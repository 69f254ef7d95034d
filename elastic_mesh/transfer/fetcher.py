"""Fetches one version of a kind from several sources at once, checking every chunk: the one download
engine of elastic_mesh, for a joiner's snapshot from its peers and for a broadcast from a swarm.

Each chunk is checked against the manifest before it is kept; a bad or missing chunk is taken from
another source, and a source that fails or lies too often is dropped for the rest of the download.
Sources are chosen by measured throughput (sources.py), chunks rarest first among the holders, and
the last chunks in flight are asked of a second source too once they are late (whichever answers
first wins), so one slow source cannot hold up the end. A peer still fetching the same version also
gets a standing request for any chunk this side lacks, answered the moment the peer verifies one: a
small version crosses each relay at the speed of its links, not of the coordinator's holder lists. Verified chunks
stay on disk (chunk_dir.py), so a restarted download resumes instead of starting over. Nothing is unpickled: the manifest is JSON, the tensors
raw bytes. Requests carry the run's transfer key.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import ssl
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import torch

from elastic_mesh.control.kept_connections import KeptConnections
from elastic_mesh.transfer.chunk_dir import ChunkDir, VersionRemoved
from elastic_mesh.transfer.chunks import (
    NothingYet,
    SourceBusy,
    TransferError,
    layout_of,
)
from elastic_mesh.transfer.evidence import (
    CREDENTIAL_HEADER,
    SIGNATURE_BYTES,
    SIGNATURE_HEADER,
    ChunkProof,
    decode_credential,
)
from elastic_mesh.transfer.schedule import (
    UNPROVEN_PATIENCE_S,
    DownloadSchedule,
    NoUsableSource,
    Request,
    endgame_patience,
)
from elastic_mesh.transfer.server import FRAME_HEAD, KEY_HEADER
from elastic_mesh.transfer.sources import SourcePicker

log = logging.getLogger(__name__)


@dataclass
class FetchReport:
    version: int
    total_bytes: int
    chunks: int
    resumed_chunks: int = 0          # already on disk from an earlier, interrupted download
    bytes_from: dict[str, int] = field(default_factory=dict)
    corrupt: list[str] = field(default_factory=list)   # "chunk 3 from host:port"
    failed: list[str] = field(default_factory=list)    # "chunk 5 from host:port: connection refused"
    seconds: float = 0.0


@dataclass(frozen=True)
class Served:
    """One chunk as a source sent it: its bytes (a seeded answer's index first) and what the source said
    of them (its signature and credential: evidence.py), None where it signs nothing."""

    data: bytes
    proof: ChunkProof | None = None


def get_chunk(key: str, timeout_s: float, source: str, path: str, conns: KeptConnections | None = None,
              tls: ssl.SSLContext | None = None, first_byte_s: float | None = None) -> Served:
    """One GET with the transfer key. With `conns` (a download stream's own connections) the connection
    to each source is kept open between chunks: a new TCP connection per chunk restarts slow start every
    time, which costs most on the long, fat links state crosses. first_byte_s: the answer must begin
    within this (a source not known to answer yet)."""
    kept = conns or KeptConnections(timeout_s, tls)
    try:
        status, headers, body = kept.exchange(source, "GET", path, headers={KEY_HEADER: key},
                                              first_byte_s=first_byte_s)
    except http.client.HTTPException as e:  # e.g. the source vanished mid-chunk (IncompleteRead)
        raise TransferError(f"{source}{path}: {type(e).__name__}: {str(e)[:120]}") from None
    finally:
        if conns is None:
            kept.close()
    if status != 200:
        _refused(status, body, source, path)
    return Served(body, _proof(headers.get(SIGNATURE_HEADER, ""), headers.get(CREDENTIAL_HEADER)))


def _proof(signature_hex: str, credential_text: str | None) -> ChunkProof | None:
    """A source's statement as its answer carried it, unchecked (None: it carried none, or a malformed one)."""
    credential = decode_credential(credential_text)
    try:
        signature = bytes.fromhex(signature_hex[:2 * SIGNATURE_BYTES + 2])
    except ValueError:
        return None
    return ChunkProof(signature, credential) if credential and len(signature) == SIGNATURE_BYTES else None


def _refused(status: int, body: bytes, source: str, path: str) -> None:
    """Raises what a chunk request's answer other than 200 means."""
    if status == 503:
        raise SourceBusy(f"{source}: busy")
    if status == 204:
        raise NothingYet(f"{source}: none of the wanted chunks arrived there meanwhile")
    raise TransferError(f"{source}{path}: HTTP {status} {body[:200].decode(errors='replace')}")


class Frame(NamedTuple):
    """One chunk of a streamed answer."""

    index: int
    data: bytes
    proof: ChunkProof | None


def stream_chunks(key: str, timeout_s: float, source: str, path: str, conns: KeptConnections,
                  size_of: Callable[[int], int | None], first_byte_s: float | None = None) -> Iterator[Frame]:
    """The frames of one streamed request (…/fresh/<bitmap>?stream=1) as they arrive. A frame whose
    size is not size_of(index) (None: no such chunk), or whose signature is not 0 or 64 bytes, ends the
    stream before its bytes are read, so a lying source cannot make this side buffer more than a chunk;
    the caller checks each chunk's hash. Raises as get_chunk does."""
    try:
        with conns.streaming(source, "GET", path, headers={KEY_HEADER: key}, first_byte_s=first_byte_s) as response:
            if response.status != 200:
                _refused(response.status, response.read(), source, path)
            credential = decode_credential(response.headers.get(CREDENTIAL_HEADER))
            while head := response.read(FRAME_HEAD.size):
                if len(head) < FRAME_HEAD.size:
                    raise TransferError(f"{source}: a stream cut inside a frame's head")
                index, size, signed = FRAME_HEAD.unpack(head)
                if size != size_of(index):
                    raise TransferError(f"{source}: a streamed frame of chunk {index} with {size} bytes, "
                                        f"not the manifest's {size_of(index)}")
                if signed not in (0, SIGNATURE_BYTES):
                    raise TransferError(f"{source}: a streamed frame with a {signed}-byte signature, not "
                                        f"{SIGNATURE_BYTES} (or none)")
                signature = response.read(signed)
                data = response.read(size)
                if len(signature) < signed or len(data) < size:
                    raise TransferError(f"{source}: a stream cut inside chunk {index}")
                yield Frame(index, data, ChunkProof(signature, credential) if signed and credential else None)
    except http.client.HTTPException as e:  # e.g. the source vanished mid-stream (IncompleteRead)
        raise TransferError(f"{source}{path}: {type(e).__name__}: {str(e)[:120]}") from None


class ChunkFetcher:
    """Fetches one version of a kind from several sources at once into work_dir (verified chunk files)."""

    def __init__(self, sources: list[str], key: str, work_dir: Path, timeout_s: float = 30.0,
                 streams_per_source: int = 2, max_failures_per_source: int = 3,
                 tls: ssl.SSLContext | None = None) -> None:
        """tls: the run's client context when its members serve over TLS (control/tls.py)."""
        if not sources:
            raise TransferError("no sources to fetch from")
        self.sources, self.key, self.work_dir = list(sources), key, Path(work_dir)
        self.timeout_s, self.streams = timeout_s, streams_per_source
        self.max_failures = max_failures_per_source
        self.tls = tls

    def _get(self, source: str, path: str, conns: KeptConnections | None = None,
             first_byte_s: float | None = None) -> Served:
        return get_chunk(self.key, self.timeout_s, source, path, conns, self.tls, first_byte_s)

    def manifests(self, kind: str, version: int | None) -> dict[str, dict]:
        """The manifest each reachable source holds for `version` (or its latest)."""
        found = {}
        for source in self.sources:
            try:
                found[source] = json.loads(self._get(source, f"/v1/{kind}/{version if version is not None else 'latest'}").data)
            except (OSError, TransferError, ValueError) as e:
                log.warning("transfer source %s: %s", source, str(e)[:200])
        return found

    def fetch(self, kind: str, version: int | None = None,
              mixed: bool = False) -> tuple[dict, dict[str, torch.Tensor], FetchReport]:
        """The `kind` of `version` (default: the newest any source holds), checked chunk by chunk.

        mixed: the sources hold different bytes of the same layout (each member's own optimizer state, say);
        each chunk is checked against the manifest of the source it came from, and the result mixes
        chunks of several sources. Otherwise they must hold the same bytes, and a minority is outvoted."""
        started = time.monotonic()
        manifests = self.manifests(kind, version)
        if not manifests:
            raise TransferError(f"none of the sources {self.sources} could serve {kind} "
                                f"{version if version is not None else '(latest)'}")
        if version is None:
            version = max(m["version"] for m in manifests.values())
            manifests = {s: m for s, m in manifests.items() if m["version"] == version}
        # The sources must describe the same bytes (mixed: the same layout); a minority that disagrees is not used.
        by_content: dict[str, list[str]] = {}
        for source, manifest in manifests.items():
            key = layout_of(manifest) if mixed else manifest
            by_content.setdefault(json.dumps(key, sort_keys=True), []).append(source)
        content, sources = max(by_content.items(), key=lambda kv: len(kv[1]))
        for other, who in by_content.items():
            if other != content:
                log.warning("%s %d: %s disagree with the majority's manifest; not used", kind, version, ", ".join(who))
        manifest = manifests[sources[0]]
        expected = [{manifests[s]["chunks"][i]["sha256"] for s in sources} for i in range(len(manifest["chunks"]))]
        target = ChunkDir(self.work_dir / f"{kind}_{version:08d}", manifest, expected)
        report = FetchReport(version, manifest["total_bytes"], len(manifest["chunks"]))
        report.resumed_chunks = target.resume()
        everything = {s: None for s in sources}
        Download(self._get, target, kind, lambda: everything, SourcePicker(self.streams, self.max_failures), report,
                 streams=self.streams * len(sources), tls=self.tls).run()
        report.seconds = time.monotonic() - started
        return manifest, target.tensors(), report


class Download:
    """Fetches every chunk `target` lacks, `streams` requests at a time, until it is complete; the
    scheduling rules are DownloadSchedule's (schedule.py), this object runs them on threads and sockets.

    get(source, path, conns): one chunk request's answer (get_chunk). holders(): source -> bitmap of the
    chunks it holds (None: all), asked again before every choice (the caller caches it). seeders():
    sources asked only for chunks no other source holds (a broadcast's origin). A failed or bad chunk
    is asked elsewhere; the download gives up (TransferError) when some missing chunk has no usable
    holder, nothing is in flight, and `stall_s` has passed without progress (0: at once).
    on_verified(index) runs after each chunk is stored; on_bad(source, index, why, served) after a bad one
    (served: the bytes and what the source signed of them, the evidence a report carries).
    wait_s: a peer still fetching that holds nothing to ask for gets one standing request at a time.
    conns: connections kept by the caller beyond this download (a member that fetches version after
    version from the same peers skips the handshakes and the slow start of new ones); the download's
    own, closed at its end, if None. stream(source, path, conns, size_of): the (index, bytes) frames
    of one streamed request (stream_chunks); with it a seeder's chunks come in one streamed answer
    instead of a request each, and every peer still fetching gets a standing stream from the start,
    over which it relays each chunk it took from a seeder the moment it verified it.

    A source that has not delivered yet (in this download, or to this member before: the picker's
    `proven`) must begin its answer within a first-byte deadline: max(first_byte_s, three times the
    median time a chunk of this download took), plus what a standing request may wait at it. A holder
    that claims chunks and never answers costs one deadline, not the ordinary time-out."""

    def __init__(self, get: Callable[[str, str, KeptConnections, float | None], Served], target: ChunkDir, kind: str,
                 holders: Callable[[], dict[str, bytes | None]], picker: SourcePicker, report: FetchReport, *,
                 streams: int, stall_s: float = 0.0, timeout_s: float = 30.0, wait_s: float = 0.0,
                 seed: int | None = None, seeders: Callable[[], set[str]] | None = None,
                 on_verified: Callable[[int], None] | None = None,
                 on_bad: Callable[[str, int, str, Served], None] | None = None, tls: ssl.SSLContext | None = None,
                 conns: KeptConnections | None = None,
                 stream: Callable[[str, str, KeptConnections, Callable[[int], int | None], float | None],
                                  Iterator[Frame]] | None = None, first_byte_s: float = 2.0) -> None:
        self.get, self.target, self.kind, self.holders, self.picker = get, target, kind, holders, picker
        self.report, self.timeout_s, self.tls, self.conns, self.stream = report, timeout_s, tls, conns, stream
        self.seeders = seeders or (lambda: set())
        self.on_verified, self.on_bad = on_verified, on_bad
        self.streams, self.first_byte_s = streams, first_byte_s
        self.schedule = DownloadSchedule(target.chunks, picker, streams, wait_s, stream is not None, stall_s, seed,
                                         last_progress=time.monotonic())
        self.errors: list[str] = []
        self._cond = threading.Condition()
        self._waiting: set[threading.Thread] = set()  # the streams whose request is a standing one
        self._asking: dict[threading.Thread, int] = {}  # the streams asking for one named chunk: which
        # Since when the seeder has had nothing new for this member (it answered an only_new request 204: it
        # sent those chunks to other members a moment ago, to be relayed). None once it sends again.
        self._withheld_since: float | None = None

    def run(self) -> None:
        """Returns once the target is complete; raises TransferError when it cannot be (never returns a
        partial version)."""
        target = self.target
        if target.complete:
            return
        threads = [threading.Thread(target=self._worker, daemon=True, name=f"fetch-{self.kind}")
                   for _ in range(max(1, min(self.streams, target.chunks - len(target.held()))))]
        for t in threads:
            t.start()
        # Done when complete (or failed), not when every stream is back: a standing request may wait at a
        # peer for seconds more, and a late request that lost the endgame's race may take as long; their
        # answers change nothing (put() keeps the first copy). Every other request ends within one answer:
        # those are waited for, so their connections are back in the caller's pool for the next version
        # (and no stream of this download outlives it for long).
        with self._cond:
            while not (self.errors or target.complete) and any(t.is_alive() for t in threads):
                self._cond.wait(0.05)
            held = target.held()
            others = [t for t in threads if t not in self._waiting and self._asking.get(t) not in held]
        for t in others:
            t.join(self.timeout_s)
        if not target.complete:  # every stream ended with chunks missing: never a silent partial version
            raise TransferError(f"{self.kind} {target.version}: "
                                f"{self.errors[0] if self.errors else 'every stream ended early'}")

    def _next(self) -> Request | None:
        """Under the condition: the next request, or None once the download is over (complete or failed)."""
        while not (self.errors or self.target.complete):
            try:
                request = self.schedule.next(self.target.held(), self.holders(), self.seeders(), time.monotonic())
            except NoUsableSource as e:
                tried = "; ".join((self.report.failed + self.report.corrupt)[-4:])
                self.errors.append(str(e) + (f" (every source failed or sent bad bytes: {tried[-500:]})"
                                             if tried else ""))
                break
            if request is not None:
                return request
            self._cond.wait(0.05)
        self._cond.notify_all()
        return None

    def _worker(self) -> None:
        own = KeptConnections(self.timeout_s, self.tls) if self.conns is None else self.conns
        me = threading.current_thread()
        try:
            while True:
                with self._cond:
                    request = self._next()
                    if request is None:
                        return
                    if request.standing:
                        self._waiting.add(me)
                    elif request.index is not None:
                        self._asking[me] = request.index
                try:
                    self._fetch(own, request)
                except Exception as e:  # noqa: BLE001 - a stream that dies ends the download, with its reason
                    if not isinstance(e, VersionRemoved):
                        log.exception("%s %d: a download stream failed", self.kind, self.target.version)
                    with self._cond:
                        self.errors.append(str(e) if isinstance(e, VersionRemoved)
                                           else f"a download stream failed: {e!r}")
                        self._cond.notify_all()
                    return
                finally:
                    self._asking.pop(me, None)
                    if request.index is None:
                        with self._cond:
                            self.schedule.finished(request)
                            self._waiting.discard(me)
                            self._cond.notify_all()
        finally:
            if self.conns is None:
                own.close()

    def _settle(self, index: int | None, source: str, outcome: str, detail: str = "", nbytes: int = 0) -> None:
        """A request to `source` ended: ok (nbytes newly stored), busy, failed or corrupt."""
        with self._cond:
            self.schedule.settle(index, source, outcome, time.monotonic())
            if outcome == "failed":
                self.report.failed.append(f"chunk {index if index is not None else '(seeded)'} from {source}: {detail}")
            elif outcome == "corrupt":
                self.report.corrupt.append(f"chunk {index} from {source}")
            elif outcome == "ok" and nbytes:
                self.report.bytes_from[source] = self.report.bytes_from.get(source, 0) + nbytes
            self._cond.notify_all()

    def _path(self, request: Request, relayed: bool) -> str:
        """The request's URL path: one chunk, or the chunks of a seeded or standing request as a bitmap."""
        version = self.target.version
        if request.index is not None:
            return f"/v1/{self.kind}/{version}/chunk/{request.index}"
        bits = bytearray((self.target.chunks + 7) // 8)
        for i in request.chunks:
            bits[i // 8] |= 1 << (i % 8)
        path = f"/v1/{self.kind}/{version}/fresh/{base64.urlsafe_b64encode(bytes(bits)).decode().rstrip('=')}"
        query = []
        if request.wait_s:
            query.append(f"wait_ms={int(request.wait_s * 1000)}")
            if self.stream:
                query.append("relayed=1")
        elif relayed:
            query.append("only_new=1")
        if self.stream:
            query.append("stream=1")
        return path + ("?" + "&".join(query) if query else "")

    def _first_byte(self, request: Request) -> float | None:
        """The first-byte deadline of `request` (None: its source delivered before; the ordinary time-out)."""
        if self.picker.proven(request.source):
            return None
        with self._cond:
            took = sorted(self.schedule.took)
        paced = 3 * took[len(took) // 2] if took else 0.0
        return min(self.timeout_s, max(self.first_byte_s, paced) + request.wait_s)

    def _fetch(self, conns: KeptConnections, request: Request) -> None:
        started, source, index = time.monotonic(), request.source, request.index
        with self._cond:
            # Peers fetching the same version (any holder not a seeder, whatever it holds yet): a chunk the
            # seeder sent one of them comes on from them, so the seeder's uplink carries each chunk once.
            seeders = self.seeders()
            relayed = bool(self.schedule.standing) or any(s not in seeders for s in self.holders())
            # ... unless what the seeder withheld has not come on within a relay's time: it went to a member
            # that does not pass it on (a leech, or one that died). Then the seeder is asked plainly.
            # A relay's time: three of this download's chunk times (endgame_patience), or before any chunk
            # came, as long as an unproven holder is given (UNPROVEN_PATIENCE_S).
            withheld = self._withheld_since
            patience = endgame_patience(self.schedule.took) if self.schedule.took else UNPROVEN_PATIENCE_S
            if withheld is not None and request.seeded and time.monotonic() - withheld >= patience:
                relayed = False
        path = self._path(request, relayed)
        if self.stream and index is None:
            return self._fetch_streamed(conns, path, request, source in seeders)
        try:
            served = self.get(source, path, conns, self._first_byte(request))
            data = served.data
            if index is None:
                if len(data) < 8 or not 0 <= (index := struct.unpack(">q", data[:8])[0]) < self.target.chunks:
                    raise TransferError(f"{source}: a seeded chunk without a valid index")
                data = data[8:]
        except NothingYet:  # a standing request that waited in vain: ask again at once; a seeder that
            # sent every wanted chunk to someone a moment ago: ask it again shortly
            self._note_withheld(request)
            self.picker.busy(source, back_off_s=0.0 if request.wait_s else 0.1)
            return self._settle(index, source, "busy")
        except SourceBusy:
            log.debug("%s busy for chunk %s", source, index if index is not None else "(seeded)")
            self.picker.busy(source)
            return self._settle(index, source, "busy")
        except (OSError, TransferError) as e:
            self.picker.failed(source)
            return self._settle(index, source, "failed", str(e)[:120])
        if not self.target.matches(index, data):
            self._bad(source, index, "sha256 mismatch", f"sent chunk {index} that does not match its hash",
                      f"chunk {index} from {source} does not match its hash", Served(data, served.proof))
            return
        self.picker.done(source, len(data), time.monotonic() - started)
        if not request.wait_s:  # a standing request's time is mostly its wait for the peer
            with self._cond:
                self.schedule.chunk_took(time.monotonic() - started)
        log.debug("%s %d chunk %d from %s in %.3f s%s", self.kind, self.target.version, index, source,
                  time.monotonic() - started, " (seeded)" if request.index is None else "")
        self._keep(index, data, source, from_seeder=source in seeders)

    def _bad(self, source: str, index: int, why: str, banned_for: str, what: str, served: Served) -> None:
        """`source` sent bytes that are not what the manifest says: it is not used again for this version."""
        self.picker.failed(source)
        self.picker.ban(source, banned_for)
        log.warning("%s %d: %s; %s is not used again for this version, the chunk is fetched elsewhere",
                    self.kind, self.target.version, what, source)
        self._settle(index if 0 <= index < self.target.chunks else None, source, "corrupt")
        if self.on_bad:
            self.on_bad(source, index, why, served)

    def _note_withheld(self, request: Request) -> None:
        if request.seeded:
            with self._cond:
                if self._withheld_since is None:
                    self._withheld_since = time.monotonic()

    def _keep(self, index: int, data: bytes, source: str, from_seeder: bool) -> None:
        if from_seeder:
            self._withheld_since = None
        fresh = self.target.put(index, data, seeded=from_seeder)
        self._settle(index, source, "ok", nbytes=len(data) if fresh else 0)
        if fresh and self.on_verified:
            self.on_verified(index)

    def _size_of(self, index: int) -> int | None:
        chunks = self.target.manifest["chunks"]
        return chunks[index]["size"] if 0 <= index < len(chunks) else None

    def _fetch_streamed(self, conns: KeptConnections, path: str, request: Request, from_seeder: bool) -> None:
        """One streamed request: every frame is checked and kept as it arrives; a bad one ends the stream
        and bans its source, as a bad chunk does."""
        started, nbytes, source, wanted = time.monotonic(), 0, request.source, set(request.chunks)
        try:
            for index, data, proof in self.stream(source, path, conns, self._size_of, self._first_byte(request)):
                if index not in wanted or not self.target.matches(index, data):
                    self._bad(source, index, "sha256 mismatch" if index in wanted else "not asked for",
                              f"streamed chunk {index} that was not asked for or does not match its hash",
                              f"chunk {index} streamed from {source} is not one asked for or does not match its hash",
                              Served(data, proof))
                    return
                nbytes += len(data)
                log.debug("%s %d chunk %d streamed from %s at %.3f s", self.kind, self.target.version, index, source,
                          time.monotonic() - started)
                self._keep(index, data, source, from_seeder)
        except NothingYet:
            self._note_withheld(request)
            self.picker.busy(source, back_off_s=0.0 if request.wait_s else 0.1)
            return self._settle(None, source, "busy")
        except SourceBusy:
            self.picker.busy(source)
            return self._settle(None, source, "busy")
        except (OSError, TransferError) as e:
            self.picker.failed(source)
            return self._settle(None, source, "failed", str(e)[:120])
        self.picker.done(source, nbytes, time.monotonic() - started)
        self._settle(None, source, "ok")
