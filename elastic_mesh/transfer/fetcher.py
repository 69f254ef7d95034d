"""Live snapshots served peer to peer.

A node publishes the state of each committed outer step as fixed-size chunks described by a
manifest (tensor names, dtypes, shapes, and a sha256 per chunk). A joiner fetches the chunks from
several peers at once, checks every chunk against the manifest, takes a bad or missing chunk from
another peer, and keeps verified chunks on disk so a restarted download resumes instead of starting
over. Nothing is unpickled: tensors travel as raw bytes; the manifest is JSON. Requests need the
run's snapshot key, which the coordinator gives only to admitted nodes.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import torch

from elastic_mesh.control.kept_connections import KeptConnections

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20
# "snapshot": the whole state of a committed outer step; "update": the averaged pseudo-gradient that made
# the step, which a node one step behind replays instead of fetching the whole state; "inner": the
# node's own inner optimizer state after that step (it differs between nodes: taken from one source).
KINDS = ("snapshot", "update", "inner")
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8)}


class SnapshotError(RuntimeError):
    """A snapshot could not be served or fetched; the message says which chunk or source and why."""


@dataclass
class Snapshot:
    step: int
    manifest: dict
    blob: bytes | memoryview

    def chunk(self, index: int) -> bytes | memoryview:
        size = self.manifest["chunk_bytes"]
        return self.blob[index * size:(index + 1) * size]


def _check_dtypes(tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        if str(tensor.dtype) not in _DTYPES:
            raise TypeError(f"snapshot tensor {name} has dtype {tensor.dtype}; supported: {sorted(_DTYPES)}")


def build_snapshot(step: int, tensors: dict[str, torch.Tensor], meta: dict | None = None,
                   chunk_bytes: int = CHUNK_BYTES) -> Snapshot:
    """Lays the tensors out back to back (CPU, contiguous) and hashes every chunk: one copy, made by
    torch without the GIL, and chunks hashed in place (bytes() + join + slicing made four copies
    under the GIL)."""
    _check_dtypes(tensors)
    entries, parts, offset = [], [], 0
    for name, tensor in tensors.items():
        data = tensor.detach().cpu().reshape(-1).view(torch.uint8)
        entries.append({"name": name, "dtype": str(tensor.dtype), "shape": list(tensor.shape), "offset": offset,
                        "nbytes": data.numel()})
        parts.append(data)
        offset += data.numel()
    # The memoryview keeps the laid-out tensor alive; it is never written again.
    blob = memoryview(torch.cat(parts).numpy()) if parts else memoryview(b"")
    chunks = [{"size": len(blob[i:i + chunk_bytes]), "sha256": hashlib.sha256(blob[i:i + chunk_bytes]).hexdigest()}
              for i in range(0, len(blob), chunk_bytes)]
    manifest = {"step": step, "chunk_bytes": chunk_bytes, "total_bytes": len(blob), "tensors": entries,
                "chunks": chunks, "meta": meta or {}}
    return Snapshot(step, manifest, blob)


class DeferredSnapshot:
    """A snapshot laid out and hashed when a peer first asks for it, not when it is published. A node
    publishes a whole snapshot (outer params, momentum, AdamW moments: 16 bytes a parameter) every H
    inner steps while it trains, and most are never fetched: built at once, each took ~0.2 s of a
    core per 100 MB here, out of compute in the overlapped modes. The tensors must be copies that
    nothing writes again; their dtypes are checked now, so a bad one fails the publisher, not a peer."""

    def __init__(self, step: int, tensors: dict[str, torch.Tensor], meta: dict | None = None,
                 chunk_bytes: int = CHUNK_BYTES, transform: Callable[[Snapshot], Snapshot] | None = None) -> None:
        _check_dtypes(tensors)
        self.step = step
        self._args: tuple | None = (tensors, meta, chunk_bytes, transform)
        self._built: Snapshot | None = None
        self._lock = threading.Lock()

    def get(self) -> Snapshot:
        with self._lock:  # concurrent first requests build it once
            if self._built is None:
                tensors, meta, chunk_bytes, transform = self._args
                built = build_snapshot(self.step, tensors, meta, chunk_bytes)
                self._built, self._args = transform(built) if transform else built, None  # the copies go
            return self._built


def snapshot_tensors(manifest: dict, blob: bytes | bytearray) -> dict[str, torch.Tensor]:
    out = {}
    for entry in manifest["tensors"]:
        raw = bytearray(blob[entry["offset"]:entry["offset"] + entry["nbytes"]])
        dtype = _DTYPES[entry["dtype"]]
        tensor = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        out[entry["name"]] = tensor.reshape(entry["shape"])
    return out


def _layout(manifest: dict) -> dict:
    """A manifest without its chunk hashes: what sources of different bytes must still agree on."""
    return {**manifest, "chunks": [c["size"] for c in manifest["chunks"]]}


# ---- serving -----------------------------------------------------------------------------------------
class _Handler(BaseHTTPRequestHandler):
    server: "SnapshotServer"
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
        if not hmac.compare_digest(self.headers.get("X-Prime-Snapshot-Key", ""), self.server.key):
            return self._error(401, "a snapshot key is needed (given to nodes the coordinator admitted)")
        parts = self.path.strip("/").split("/")  # v1/<kind>/<latest|step>[/chunk/<i>]
        if len(parts) < 3 or parts[0] != "v1" or parts[1] not in KINDS:
            return self._error(404, f"no such endpoint {self.path[:100]}")
        snapshot = self.server.get(parts[1], parts[2])
        if snapshot is None:
            return self._error(404, f"no {parts[1]} {parts[2][:20]} here (held: {self.server.steps(parts[1])})")
        if len(parts) == 3:
            return self._send(200, json.dumps(snapshot.manifest).encode())
        if len(parts) == 5 and parts[3] == "chunk" and parts[4].isdigit() and \
                int(parts[4]) < len(snapshot.manifest["chunks"]):
            if self.server.serve_delay_s:
                time.sleep(self.server.serve_delay_s)
            return self._send(200, snapshot.chunk(int(parts[4])), "application/octet-stream")
        return self._error(404, f"no such chunk {self.path[:100]}")


class SnapshotServer(ThreadingHTTPServer):
    """Serves this process's newest `keep` snapshots and updates. serve_delay_s slows every chunk (an
    emulated slow uplink for tests and benchmarks; 0 in production)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, port: int, key: str, keep: int = 2, keep_snapshots: int = 2,
                 serve_delay_s: float = 0.0, pin_s: float = 60.0) -> None:
        """keep: updates held; keep_snapshots: whole snapshots held (each is 2× the shard: params + momentum).
        An older one is also held while someone fetched from it in the last pin_s seconds, so a download
        over a slow link that outlasts a few rounds still completes."""
        super().__init__((host, port), _Handler)
        self.key, self.serve_delay_s, self.pin_s = key, serve_delay_s, pin_s
        self.keep = {"snapshot": keep_snapshots, "update": keep, "inner": keep_snapshots}
        self._last_read: dict[tuple[str, int], float] = {}
        self._held: dict[str, dict[int, Snapshot | DeferredSnapshot]] = {kind: {} for kind in KINDS}
        self._lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True, name="snapshot-server").start()

    @property
    def port(self) -> int:
        return self.server_address[1]

    def handle_error(self, request, client_address) -> None:
        # A fetcher that died or gave up mid-chunk is routine here, not worth a traceback on stderr.
        log.debug("snapshot request from %s ended early", client_address, exc_info=True)

    def publish(self, snapshot: Snapshot | DeferredSnapshot, kind: str = "snapshot") -> None:
        with self._lock:
            held = self._held[kind]
            held[snapshot.step] = snapshot
            now = time.monotonic()
            for old in sorted(held)[:-self.keep[kind]]:
                if now - self._last_read.get((kind, old), -math.inf) > self.pin_s:
                    del held[old]
                    self._last_read.pop((kind, old), None)

    def get(self, kind: str, which: str) -> Snapshot | None:
        with self._lock:
            held = self._held[kind]
            if which == "latest":
                found = held[max(held)] if held else None
            else:
                found = held.get(int(which)) if which.isdigit() else None
            if found is not None:
                self._last_read[(kind, found.step)] = time.monotonic()
        # A deferred one is built outside the server's lock: other requests go on meanwhile.
        return found.get() if isinstance(found, DeferredSnapshot) else found

    def steps(self, kind: str = "snapshot") -> list[int]:
        with self._lock:
            return sorted(self._held[kind])

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


# ---- fetching ----------------------------------------------------------------------------------------
@dataclass
class FetchReport:
    step: int
    total_bytes: int
    chunks: int
    resumed_chunks: int = 0          # already on disk from an earlier, interrupted download
    bytes_from: dict[str, int] = field(default_factory=dict)
    corrupt: list[str] = field(default_factory=list)   # "chunk 3 from host:port"
    failed: list[str] = field(default_factory=list)    # "chunk 5 from host:port: connection refused"
    seconds: float = 0.0


class SnapshotFetcher:
    """Fetches one snapshot from several sources at once into work_dir (verified chunk files)."""

    def __init__(self, sources: list[str], key: str, work_dir: Path, timeout_s: float = 30.0,
                 streams_per_source: int = 2, max_failures_per_source: int = 3) -> None:
        if not sources:
            raise SnapshotError("no sources to fetch a snapshot from")
        self.sources, self.key, self.work_dir = list(sources), key, Path(work_dir)
        self.timeout_s, self.streams = timeout_s, streams_per_source
        self.max_failures = max_failures_per_source

    def _get(self, source: str, path: str, conns: KeptConnections | None = None) -> bytes:
        """One GET. With `conns` (a download stream's own connections) the connection to each source is
        kept open between chunks: a new TCP connection per 4 MiB chunk restarts slow start every time,
        which costs most on the long, fat links snapshots cross."""
        kept = conns or KeptConnections(self.timeout_s)
        try:
            status, body = kept.request(source, "GET", path, headers={"X-Prime-Snapshot-Key": self.key})
        except http.client.HTTPException as e:  # e.g. the source vanished mid-chunk (IncompleteRead)
            raise SnapshotError(f"{source}{path}: {type(e).__name__}: {str(e)[:120]}") from None
        finally:
            if conns is None:
                kept.close()
        if status != 200:
            raise SnapshotError(f"{source}{path}: HTTP {status} {body[:200].decode(errors='replace')}")
        return body

    def manifests(self, step: int | None, kind: str) -> dict[str, dict]:
        """The manifest each reachable source holds for `step` (or its latest)."""
        found = {}
        for source in self.sources:
            try:
                found[source] = json.loads(self._get(source, f"/v1/{kind}/{step if step is not None else 'latest'}"))
            except (OSError, SnapshotError, ValueError) as e:
                log.warning("snapshot source %s: %s", source, str(e)[:200])
        return found

    def fetch(self, step: int | None = None, kind: str = "snapshot",
              mixed: bool = False) -> tuple[dict, dict[str, torch.Tensor], FetchReport]:
        """The `kind` of `step` (default: the newest any source holds), checked chunk by chunk.

        mixed: the sources hold different bytes of the same layout (each node's own optimizer moments);
        each chunk is checked against the manifest of the source it came from, and the result mixes
        chunks of several sources. Otherwise they must hold the same bytes, and a minority is outvoted."""
        started = time.monotonic()
        manifests = self.manifests(step, kind)
        if not manifests:
            raise SnapshotError(f"none of the sources {self.sources} could serve {kind} "
                                f"{step if step is not None else '(latest)'}")
        if step is None:
            step = max(m["step"] for m in manifests.values())
            manifests = {s: m for s, m in manifests.items() if m["step"] == step}
        # The sources must describe the same bytes (mixed: the same layout); a minority that disagrees is not used.
        by_content: dict[str, list[str]] = {}
        for source, manifest in manifests.items():
            key = _layout(manifest) if mixed else manifest
            by_content.setdefault(json.dumps(key, sort_keys=True), []).append(source)
        content, sources = max(by_content.items(), key=lambda kv: len(kv[1]))
        for other, who in by_content.items():
            if other != content:
                log.warning("snapshot %d: %s disagree with the majority's manifest; not used", step, ", ".join(who))
        manifest = manifests[sources[0]]
        hashes = {s: [c["sha256"] for c in manifests[s]["chunks"]] for s in sources}
        report = FetchReport(step, manifest["total_bytes"], len(manifest["chunks"]))
        directory = self.work_dir / f"{kind}_{step:08d}"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "manifest.json").write_text(json.dumps(manifest))
        pending = queue.Queue()
        for index in range(len(manifest["chunks"])):
            path = directory / f"chunk_{index:06d}"
            if path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() in {h[index] for h in hashes.values()}:
                report.resumed_chunks += 1
            else:
                pending.put((index, frozenset()))
        self._download(manifest, hashes, kind, directory, pending, sources, report)
        blob = bytearray()
        for index in range(len(manifest["chunks"])):
            blob += (directory / f"chunk_{index:06d}").read_bytes()
        report.seconds = time.monotonic() - started
        return manifest, snapshot_tensors(manifest, blob), report

    def _download(self, manifest: dict, hashes: dict[str, list[str]], kind: str, directory: Path,
                  pending: queue.Queue, sources: list[str], report: FetchReport) -> None:
        lock = threading.Lock()
        failures = {s: 0 for s in sources}
        errors: list[str] = []
        remaining = [pending.qsize()]
        turn = [0]

        def usable(excluded: frozenset) -> list[str]:
            return [s for s in sources if failures[s] < self.max_failures and s not in excluded]

        def worker() -> None:
            conns = KeptConnections(self.timeout_s)
            try:
                fetch_chunks(conns)
            finally:
                conns.close()

        def fetch_chunks(conns: KeptConnections) -> None:
            while True:
                with lock:
                    if remaining[0] == 0 or errors:
                        return
                try:
                    index, excluded = pending.get(timeout=0.2)
                except queue.Empty:
                    continue
                with lock:
                    choices = usable(excluded)
                    if not choices:
                        errors.append(f"chunk {index}: every source failed or sent bad bytes "
                                      f"({'; '.join(report.failed + report.corrupt)[-500:]})")
                        return
                    source = choices[turn[0] % len(choices)]  # spread the chunks over the sources
                    turn[0] += 1
                expected = {"size": manifest["chunks"][index]["size"], "sha256": hashes[source][index]}
                try:
                    data = self._get(source, f"/v1/{kind}/{manifest['step']}/chunk/{index}", conns)
                except (OSError, SnapshotError) as e:
                    with lock:
                        failures[source] += 1
                        report.failed.append(f"chunk {index} from {source}: {str(e)[:120]}")
                    pending.put((index, excluded | {source}))
                    continue
                if len(data) != expected["size"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
                    with lock:
                        failures[source] += 1
                        report.corrupt.append(f"chunk {index} from {source}")
                    log.warning("snapshot chunk %d from %s does not match its hash; fetching it elsewhere", index, source)
                    pending.put((index, excluded | {source}))
                    continue
                staging = directory / f".chunk_{index:06d}.tmp"
                staging.write_bytes(data)
                staging.replace(directory / f"chunk_{index:06d}")  # a chunk file on disk is always whole
                with lock:
                    report.bytes_from[source] = report.bytes_from.get(source, 0) + len(data)
                    remaining[0] -= 1

        threads = [threading.Thread(target=worker, daemon=True)
                   for _ in range(min(self.streams * len(sources), max(1, remaining[0])))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise SnapshotError(f"{kind} {manifest['step']}: {errors[0]}")
