"""Fetches one version of a kind from several sources at once, checking every chunk.

Each chunk is checked against the manifest before it is kept; a bad or missing chunk is taken from
another source, and a source that fails or lies too often is dropped for the rest of the download.
Verified chunks stay on disk, so a restarted download resumes instead of starting over. Nothing is
unpickled: the manifest is JSON, the tensors raw bytes. Requests carry the run's transfer key.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from elastic_mesh.control.kept_connections import KeptConnections
from elastic_mesh.transfer.chunks import TransferError, layout_of, tensors_from
from elastic_mesh.transfer.server import KEY_HEADER

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


class ChunkFetcher:
    """Fetches one version of a kind from several sources at once into work_dir (verified chunk files)."""

    def __init__(self, sources: list[str], key: str, work_dir: Path, timeout_s: float = 30.0,
                 streams_per_source: int = 2, max_failures_per_source: int = 3) -> None:
        if not sources:
            raise TransferError("no sources to fetch from")
        self.sources, self.key, self.work_dir = list(sources), key, Path(work_dir)
        self.timeout_s, self.streams = timeout_s, streams_per_source
        self.max_failures = max_failures_per_source

    def _get(self, source: str, path: str, conns: KeptConnections | None = None) -> bytes:
        """One GET. With `conns` (a download stream's own connections) the connection to each source is
        kept open between chunks: a new TCP connection per 4 MiB chunk restarts slow start every time,
        which costs most on the long, fat links state crosses."""
        kept = conns or KeptConnections(self.timeout_s)
        try:
            status, body = kept.request(source, "GET", path, headers={KEY_HEADER: self.key})
        except http.client.HTTPException as e:  # e.g. the source vanished mid-chunk (IncompleteRead)
            raise TransferError(f"{source}{path}: {type(e).__name__}: {str(e)[:120]}") from None
        finally:
            if conns is None:
                kept.close()
        if status != 200:
            raise TransferError(f"{source}{path}: HTTP {status} {body[:200].decode(errors='replace')}")
        return body

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
        hashes = {s: [c["sha256"] for c in manifests[s]["chunks"]] for s in sources}
        report = FetchReport(version, manifest["total_bytes"], len(manifest["chunks"]))
        directory = self.work_dir / f"{kind}_{version:08d}"
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
        return manifest, tensors_from(manifest, blob), report

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
                    data = self._get(source, f"/v1/{kind}/{manifest['version']}/chunk/{index}", conns)
                except (OSError, TransferError) as e:
                    with lock:
                        failures[source] += 1
                        report.failed.append(f"chunk {index} from {source}: {str(e)[:120]}")
                    pending.put((index, excluded | {source}))
                    continue
                if len(data) != expected["size"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
                    with lock:
                        failures[source] += 1
                        report.corrupt.append(f"chunk {index} from {source}")
                    log.warning("%s chunk %d from %s does not match its hash; fetching it elsewhere", kind, index, source)
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
            raise TransferError(f"{kind} {manifest['version']}: {errors[0]}")
