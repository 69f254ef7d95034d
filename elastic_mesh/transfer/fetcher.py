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
import random
import ssl
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from elastic_mesh.control.kept_connections import KeptConnections
from elastic_mesh.transfer.chunk_dir import ChunkDir, VersionRemoved, bitmap_has
from elastic_mesh.transfer.chunks import (
    NothingYet,
    SourceBusy,
    TransferError,
    layout_of,
)
from elastic_mesh.transfer.server import KEY_HEADER
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


def get_chunk(key: str, timeout_s: float, source: str, path: str, conns: KeptConnections | None = None,
              tls: ssl.SSLContext | None = None) -> bytes:
    """One GET with the transfer key. With `conns` (a download stream's own connections) the connection
    to each source is kept open between chunks: a new TCP connection per chunk restarts slow start every
    time, which costs most on the long, fat links state crosses."""
    kept = conns or KeptConnections(timeout_s, tls)
    try:
        status, body = kept.request(source, "GET", path, headers={KEY_HEADER: key})
    except http.client.HTTPException as e:  # e.g. the source vanished mid-chunk (IncompleteRead)
        raise TransferError(f"{source}{path}: {type(e).__name__}: {str(e)[:120]}") from None
    finally:
        if conns is None:
            kept.close()
    if status != 200:
        _refused(status, body, source, path)
    return body


def _refused(status: int, body: bytes, source: str, path: str) -> None:
    """Raises what a chunk request's answer other than 200 means."""
    if status == 503:
        raise SourceBusy(f"{source}: busy")
    if status == 204:
        raise NothingYet(f"{source}: none of the wanted chunks arrived there meanwhile")
    raise TransferError(f"{source}{path}: HTTP {status} {body[:200].decode(errors='replace')}")


FRAME_HEAD = struct.Struct(">qq")  # a streamed chunk's index and size, then its bytes (server.py)


def stream_chunks(key: str, timeout_s: float, source: str, path: str, conns: KeptConnections,
                  size_of: Callable[[int], int | None]) -> Iterator[tuple[int, bytes]]:
    """The (index, bytes) frames of one streamed request (…/fresh/<bitmap>?stream=1) as they arrive. A
    frame whose size is not size_of(index) (None: no such chunk) ends the stream before its bytes are
    read, so a lying source cannot make this side buffer more than a chunk; the caller checks each
    chunk's hash. Raises as get_chunk does."""
    try:
        with conns.streaming(source, "GET", path, headers={KEY_HEADER: key}) as response:
            if response.status != 200:
                _refused(response.status, response.read(), source, path)
            while head := response.read(FRAME_HEAD.size):
                if len(head) < FRAME_HEAD.size:
                    raise TransferError(f"{source}: a stream cut inside a frame's head")
                index, size = FRAME_HEAD.unpack(head)
                if size != size_of(index):
                    raise TransferError(f"{source}: a streamed frame of chunk {index} with {size} bytes, "
                                        f"not the manifest's {size_of(index)}")
                data = response.read(size)
                if len(data) < size:
                    raise TransferError(f"{source}: a stream cut inside chunk {index}")
                yield index, data
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

    def _get(self, source: str, path: str, conns: KeptConnections | None = None) -> bytes:
        return get_chunk(self.key, self.timeout_s, source, path, conns, self.tls)

    def manifests(self, kind: str, version: int | None) -> dict[str, dict]:
        """The manifest each reachable source holds for `version` (or its latest)."""
        found = {}
        for source in self.sources:
            try:
                found[source] = json.loads(self._get(source, f"/v1/{kind}/{version if version is not None else 'latest'}"))
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
        download(self._get, target, kind, lambda: everything,
                 SourcePicker(self.streams, self.max_failures), report, streams=self.streams * len(sources),
                 tls=self.tls)
        report.seconds = time.monotonic() - started
        return manifest, target.tensors(), report


ENDGAME_MIN_S = 0.25    # a chunk in flight at least this long may be asked of a second source
ENDGAME_FIRST_S = 1.0   # ... before any chunk of the download has arrived to tell the usual pace


def endgame_patience(took: list[float]) -> float:
    """How long a chunk's request may be in flight before the endgame asks a second source too: three
    times the median time a chunk of this download has taken so far (a late one, not the usual pace)."""
    if not took:
        return ENDGAME_FIRST_S
    return max(ENDGAME_MIN_S, 3 * sorted(took)[len(took) // 2])


def download(get: Callable[[str, str, KeptConnections], bytes], target: ChunkDir, kind: str,
             holders: Callable[[], dict[str, bytes | None]], picker: SourcePicker, report: FetchReport,
             streams: int, stall_s: float = 0.0, on_verified: Callable[[int], None] | None = None,
             on_bad: Callable[[str, int, str], None] | None = None, timeout_s: float = 30.0,
             seed: int | None = None, seeders: Callable[[], set[str]] | None = None,
             tls: ssl.SSLContext | None = None, conns: KeptConnections | None = None,
             wait_s: float = 0.0,
             stream: Callable[[str, str, KeptConnections, Callable[[int], int | None]],
                              Iterator[tuple[int, bytes]]] | None = None) -> None:
    """Fetches every chunk `target` lacks, `streams` at a time, until it is complete.

    holders(): source -> bitmap of the chunks it holds (None: all), asked again before every choice (the
    caller caches it). A chunk goes to the source `picker` prefers among its holders, rarest chunks
    first; a failed or bad chunk is asked elsewhere. Gives up (TransferError) when some missing chunk has
    no usable holder, nothing is in flight, and `stall_s` has passed without progress (0: at once).
    on_verified(index) runs after each chunk is stored; on_bad(source, index, why) after a bad one.
    seeders(): sources asked only for chunks that no other source holds (a broadcast's origin: its uplink
    must carry each chunk about once, and the members pass it on). A source with a partial bitmap (a
    peer still fetching) that holds nothing to ask for gets one standing request at a time (wait_s).
    conns: connections kept by the caller beyond this download (a member that fetches version after
    version from the same peers skips the handshakes and the slow start of new ones); the download's
    own, closed at its end, if None.
    stream(source, path, conns, size_of): (index, bytes) frames of one streamed request (stream_chunks). With it,
    a seeder's chunks come in one streamed answer instead of a request each, and every peer still
    fetching gets a standing stream from the start, over which it sends each chunk it took from a
    seeder the moment it has verified it (the split a seeder made is relayed by each part's holder to
    everyone); such a peer is not asked for single chunks meanwhile, which its stream brings anyway."""
    n = target.chunks
    rng = random.Random(seed)
    cond = threading.Condition()
    in_flight: dict[int, set[str]] = {}
    asked_at: dict[int, float] = {}  # chunk -> when its (first) request in flight went out
    took: list[float] = []  # seconds each chunk of this download took, for the endgame's patience
    excluded: dict[int, set[str]] = {}  # chunk -> sources that failed it or sent bad bytes
    errors: list[str] = []
    last_progress = [time.monotonic()]
    seeding = [0]  # seeded requests in flight (their chunk is known only when they answer)
    standing: set[str] = set()  # peers holding one of this download's standing requests
    streamed_from: set[str] = set()  # seeders streaming to this download now (one stream each is enough)
    waiting: set[threading.Thread] = set()  # the streams whose request is a standing one
    asking: dict[threading.Thread, int] = {}  # the streams asking for one named chunk: which
    order = list(range(n))
    rng.shuffle(order)

    def size_of(index: int) -> int | None:
        return target.manifest["chunks"][index]["size"] if 0 <= index < n else None  # ties in rarity broken differently by every member, so they fetch different chunks

    def choose() -> tuple[int | list[int], str, float] | None:
        """Under cond: the next (chunk, source, 0), or (chunks, source, wait) for a request of whichever
        of those chunks the source sent least (a seeder: wait 0; a peer still fetching: a standing
        request); None if nothing can start now."""
        held = target.held()
        where = holders()
        usable = [s for s in where if picker.usable(s)]
        last_resort = seeders() if seeders else set()
        missing = [i for i in order if i not in held]
        fresh = [i for i in missing if i not in in_flight]
        # Endgame: every missing chunk is in flight; ask a second source for one that is late, first answer
        # wins. Only a late one: on links that every chunk shares, a duplicate of one on its way at the
        # usual pace costs the uplink it comes from (often the origin's) and this side's downlink as
        # much as the chunk itself, and ends no sooner.
        now = time.monotonic()
        patience = endgame_patience(took)
        pool = fresh or [i for i in missing if len(in_flight.get(i, ())) == 1
                         and now - asked_at.get(i, now) >= patience]
        if stream and wait_s and fresh and len(standing) < max(1, streams - 2):
            streaming_peers = [s for s in usable if where[s] is not None and s not in last_resort and s not in standing]
            if streaming_peers and (source := picker.pick(streaming_peers)) is not None:
                standing.add(source)
                return fresh, source, wait_s
        ranked = []
        for index in pool:
            have = [s for s in usable if bitmap_has(where[s], index) and s not in excluded.get(index, ())
                    and s not in in_flight.get(index, ()) and not (stream and (s in standing or s in streamed_from))]
            others = [s for s in have if s not in last_resort]
            if others or have:
                ranked.append((len(others), index, others or have))
        ranked.sort(key=lambda r: r[0])  # stable: rarest first, ties in this member's shuffled order
        for rarity, index, have in ranked:
            source = picker.pick(have)
            if source is None:
                continue
            if rarity == 0 and source in last_resort and fresh:
                # Only seeders hold it: let the seeder choose among every such chunk (super-seeding).
                only_there = [i for r, i, h in ranked if r == 0 and source in h]
                return only_there, source, 0.0
            if index not in in_flight:
                asked_at[index] = time.monotonic()
            in_flight.setdefault(index, set()).add(source)
            return index, source, 0.0
        peers = [s for s in usable if wait_s and fresh and where[s] is not None and s not in last_resort
                 and s not in standing]
        if peers and (source := picker.pick(peers)) is not None:
            standing.add(source)
            return fresh, source, wait_s
        if not in_flight and not seeding[0] and missing and not ranked and \
                time.monotonic() - last_progress[0] >= stall_s:
            index = missing[0]
            tried = "; ".join((report.failed + report.corrupt)[-4:])
            errors.append(f"chunk {index}: no usable source holds it"
                          + (f" (every source failed or sent bad bytes: {tried[-500:]})" if tried else ""))
        return None

    def worker() -> None:
        own = KeptConnections(timeout_s, tls) if conns is None else conns
        try:
            while True:
                with cond:
                    while True:
                        if errors or target.complete:
                            cond.notify_all()
                            return
                        picked = choose()
                        if picked is not None or errors:
                            break
                        cond.wait(0.05)
                    if picked is None:
                        continue
                    chunk, source, wait = picked
                    if isinstance(chunk, list) and not wait:
                        seeding[0] += 1
                        streamed_from.add(source)
                    if wait:
                        waiting.add(threading.current_thread())
                    elif not isinstance(chunk, list):
                        asking[threading.current_thread()] = chunk
                try:
                    fetch_one(own, chunk, source, wait)
                except Exception as e:  # noqa: BLE001 - a stream that dies ends the download, with its reason
                    if not isinstance(e, VersionRemoved):
                        log.exception("%s %d: a download stream failed", kind, target.version)
                    with cond:
                        errors.append(str(e) if isinstance(e, VersionRemoved) else f"a download stream failed: {e!r}")
                        cond.notify_all()
                    return
                finally:
                    asking.pop(threading.current_thread(), None)
                    if isinstance(chunk, list):
                        with cond:
                            if wait:
                                standing.discard(source)
                                waiting.discard(threading.current_thread())
                            else:
                                seeding[0] -= 1
                                streamed_from.discard(source)
                            cond.notify_all()
        finally:
            if conns is None:
                own.close()

    def settle(index: int | None, source: str, outcome: str, detail: str = "", nbytes: int = 0) -> None:
        """A request to `source` ended: ok (nbytes newly stored), busy, failed or corrupt."""
        with cond:
            if index is not None and index in in_flight:
                in_flight[index].discard(source)
                if not in_flight[index]:
                    del in_flight[index]
                    asked_at.pop(index, None)
            if outcome in ("failed", "corrupt") and index is not None:
                excluded.setdefault(index, set()).add(source)
            if outcome == "failed":
                report.failed.append(f"chunk {index if index is not None else '(seeded)'} from {source}: {detail}")
            elif outcome == "corrupt":
                report.corrupt.append(f"chunk {index} from {source}")
            elif outcome == "ok":
                if nbytes:
                    report.bytes_from[source] = report.bytes_from.get(source, 0) + nbytes
                last_progress[0] = time.monotonic()
            cond.notify_all()

    def fetch_one(conns: KeptConnections, chunk: int | list[int], source: str, wait: float = 0.0) -> None:
        started = time.monotonic()
        seeded = isinstance(chunk, list)
        with cond:
            # Peers fetching the same version (any holder not a seeder, whatever it holds yet): a chunk the
            # seeder sent one of them comes on from them, so the seeder's uplink carries each chunk once.
            last_resort = seeders() if seeders else set()
            relayed = bool(standing) or any(s not in last_resort for s in holders())
        index = None if seeded else chunk
        if seeded:
            bits = bytearray((n + 7) // 8)
            for i in chunk:
                bits[i // 8] |= 1 << (i % 8)
            path = f"/v1/{kind}/{target.version}/fresh/{base64.urlsafe_b64encode(bytes(bits)).decode().rstrip('=')}"
            query = []
            if wait:
                query.append(f"wait_ms={int(wait * 1000)}")
                if stream:
                    query.append("relayed=1")
            elif relayed:
                query.append("only_new=1")
            if stream:
                query.append("stream=1")
            if query:
                path += "?" + "&".join(query)
            if stream:
                return fetch_streamed(conns, path, source, set(chunk), source in last_resort, standing=bool(wait))
        else:
            path = f"/v1/{kind}/{target.version}/chunk/{index}"
        try:
            data = get(source, path, conns)
            if seeded:
                if len(data) < 8 or not 0 <= (index := struct.unpack(">q", data[:8])[0]) < n:
                    raise TransferError(f"{source}: a seeded chunk without a valid index")
                data = data[8:]
        except NothingYet:  # a standing request that waited in vain: ask again at once; a seeder that
            # sent every wanted chunk to someone a moment ago: ask it again shortly
            picker.busy(source, back_off_s=0.0 if wait else 0.1)
            return settle(index, source, "busy")
        except SourceBusy:
            log.debug("%s busy for chunk %s", source, index if index is not None else "(seeded)")
            picker.busy(source)
            return settle(index, source, "busy")
        except (OSError, TransferError) as e:
            picker.failed(source)
            return settle(index, source, "failed", str(e)[:120])
        if not target.matches(index, data):
            picker.failed(source)
            picker.ban(source, f"sent chunk {index} that does not match its hash")
            log.warning("%s %d: chunk %d from %s does not match its hash; %s is not used again for this "
                        "version, the chunk is fetched elsewhere", kind, target.version, index, source, source)
            settle(index, source, "corrupt")
            if on_bad:
                on_bad(source, index, "sha256 mismatch")
            return
        picker.done(source, len(data), time.monotonic() - started)
        if not wait:  # a standing request's time is mostly its wait for the peer
            with cond:
                took.append(time.monotonic() - started)
        log.debug("%s %d chunk %d from %s in %.3f s%s", kind, target.version, index, source,
                  time.monotonic() - started, " (seeded)" if seeded else "")
        keep(index, data, source, from_seeder=source in last_resort)

    def keep(index: int, data: bytes, source: str, from_seeder: bool) -> None:
        fresh = target.put(index, data, seeded=from_seeder)
        settle(index, source, "ok", nbytes=len(data) if fresh else 0)
        if fresh and on_verified:
            on_verified(index)

    def fetch_streamed(conns: KeptConnections, path: str, source: str, wanted: set[int], from_seeder: bool,
                       standing: bool) -> None:
        """One streamed request: every frame is checked and kept as it arrives; a bad one ends the stream
        and bans its source, as a bad chunk does."""
        started, nbytes = time.monotonic(), 0
        try:
            for index, data in stream(source, path, conns, size_of):
                if index not in wanted or not target.matches(index, data):
                    picker.failed(source)
                    picker.ban(source, f"streamed chunk {index} that was not asked for or does not match its hash")
                    log.warning("%s %d: chunk %d streamed from %s is not one asked for or does not match its hash; "
                                "%s is not used again for this version", kind, target.version, index, source, source)
                    settle(index if 0 <= index < n else None, source, "corrupt")
                    if on_bad:
                        on_bad(source, index, "sha256 mismatch" if index in wanted else "not asked for")
                    return
                nbytes += len(data)
                log.debug("%s %d chunk %d streamed from %s at %.3f s", kind, target.version, index, source,
                          time.monotonic() - started)
                keep(index, data, source, from_seeder)
        except NothingYet:
            picker.busy(source, back_off_s=0.0 if standing else 0.1)
            return settle(None, source, "busy")
        except SourceBusy:
            picker.busy(source)
            return settle(None, source, "busy")
        except (OSError, TransferError) as e:
            picker.failed(source)
            return settle(None, source, "failed", str(e)[:120])
        picker.done(source, nbytes, time.monotonic() - started)
        settle(None, source, "ok")

    if target.complete:
        return
    threads = [threading.Thread(target=worker, daemon=True, name=f"fetch-{kind}")
               for _ in range(max(1, min(streams, n - len(target.held()))))]
    for t in threads:
        t.start()
    # Done when complete (or failed), not when every stream is back: a standing request may wait at a
    # peer for seconds more, and a late request that lost the endgame's race may take as long; their
    # answers change nothing (put() keeps the first copy). Every other request ends within one answer:
    # those are waited for, so their connections are back in the caller's pool for the next version
    # (and no stream of this download outlives it for long).
    with cond:
        while not (errors or target.complete) and any(t.is_alive() for t in threads):
            cond.wait(0.05)
        held = target.held()
        others = [t for t in threads if t not in waiting and asking.get(t) not in held]
    for t in others:
        t.join(timeout_s)
    if not target.complete:  # every stream ended with chunks missing: never a silent partial version
        raise TransferError(f"{kind} {target.version}: {errors[0] if errors else 'every stream ended early'}")
