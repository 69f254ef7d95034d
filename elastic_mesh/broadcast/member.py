"""A member of a broadcast: publishes versions, fetches them from the swarm, and serves what it holds.

Every member is a relay: the chunks it has verified are served from its own chunk server the moment
they are on disk, and the coordinator is told which ones it holds, so the origin's uplink carries each
chunk about once and the members' uplinks carry the rest. The manifest of every version comes from
the coordinator, signed with the run's key; a member checks the signature (against the key whose
fingerprint its token carries) before it uses a byte, and every chunk against the manifest. A source
that sends a bad chunk is named in the log, reported to the coordinator and not used again for that
version; the chunk is fetched elsewhere.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from pathlib import Path
from typing import Callable

import torch
from pydantic import BaseModel, ConfigDict, Field

from elastic_mesh.broadcast.holder_view import HolderView
from elastic_mesh.control.client import CoordinatorClient, CoordinatorError
from elastic_mesh.control.kept_connections import KeptConnections
from elastic_mesh.control.signing import SignatureError, fingerprint, verify
from elastic_mesh.control.tls import MemberIdentity
from elastic_mesh.control.token import read_token
from elastic_mesh.transfer.chunk_dir import ChunkDir
from elastic_mesh.transfer.chunks import (
    Chunked,
    TransferError,
    check_manifest,
    lay_out,
    root_hash,
)
from elastic_mesh.transfer.evidence import ChunkSigner, EvidenceError, sha256_hex
from elastic_mesh.transfer.fetcher import (
    Download,
    FetchReport,
    Served,
    get_chunk,
    stream_chunks,
)
from elastic_mesh.transfer.server import ChunkServer
from elastic_mesh.transfer.sources import SourcePicker

log = logging.getLogger(__name__)


class BroadcastError(RuntimeError):
    """A broadcast cannot go on: refused, forged, or no source left; the message says which and why."""


SUSPECT_DOWNLOADS = 8  # downloads for which a source that failed without delivering is asked last


class BroadcastSettings(BaseModel):
    """How a member fetches, serves and keeps versions."""

    model_config = ConfigDict(extra="forbid")

    keep: int = Field(2, ge=1, description="Versions of the kind this member keeps on disk and serves; older "
                      "ones are deleted once a newer one is complete.")
    streams: int = Field(6, ge=1, le=64, description="Chunks fetched at once, over all sources.")
    streams_per_source: int = Field(2, ge=1, le=16, description="Chunks asked of one source at once.")
    timeout_s: float = Field(10.0, gt=0, description="A source silent this long in one chunk has failed it.")
    first_byte_s: float = Field(2.0, gt=0, description="A source that never delivered to this member must begin "
                                "answering within this (or three times a chunk's usual time, if longer): a holder "
                                "that claims chunks and never answers costs a download this, not timeout_s.")
    max_failures: int = Field(3, ge=1, description="Failures after which a source is not used again by one "
                              "download (a bad chunk bans it at once).")
    stall_s: float = Field(60.0, ge=0, description="Give up when no source holds a missing chunk for this long.")
    refresh_s: float = Field(0.2, gt=0, description="How often a download asks the coordinator who holds what.")
    refresh_first_s: float = Field(0.05, gt=0, description="How often it asks during the download's first "
                                   "second: a small version is over by then, and a member learns sooner that a "
                                   "peer holds a chunk; a long download settles to refresh_s.")
    standing_wait_s: float = Field(2.0, ge=0, le=5, description="How long a standing request waits at a peer "
                                   "that is fetching the same version, to be answered with the first chunk it "
                                   "verifies that this member lacks (0: none; chunks then go on from a relay only "
                                   "once the coordinator's holder list names them).")
    stream: bool = Field(True, description="Ask a seeder for its chunks in one streamed answer, and keep a "
                         "standing stream open to every peer fetching the same version, over which it sends each "
                         "chunk it took from the seeder as soon as it has verified it (False: one request per "
                         "chunk, and a standing request answers with one chunk).")
    stream_below_mb: float = Field(16.0, ge=0, description="Streams only for versions up to this size, MiB: "
                                   "a 64 MB version to 8 members over 16 Mbit/s took 92.7 s streamed against 40.5 s "
                                   "a request per chunk (launch/bench/broadcast.py); an RL policy of 1.2 MB 0.54 s "
                                   "against 0.84 s.")
    upload_slots: int = Field(4, ge=1, le=64, description="Chunks this member sends at once; more requests are "
                              "told to ask elsewhere (a seeder that serves everyone at once finishes no chunk soon).")
    follow_overlap: int = Field(1, ge=1, le=4, description="Versions a follower downloads at once: with 2, a "
                                "version announced while the last one's final chunks are still coming starts at "
                                "once instead of after them (a stream of small versions, such as an RL policy's).")
    chunk_mb: float = Field(0.5, gt=0, le=256, description="Publishing: the chunk size, MiB. Smaller chunks let "
                            "relays pass bytes on sooner; larger ones cost fewer requests.")
    host: str = Field("0.0.0.0", description="Address the chunk server listens on.")
    port: int = Field(0, ge=0, lt=65536, description="Port of the chunk server (0: any free one).")
    advertise_host: str | None = Field(None, description="Host others reach this member's chunk server at "
                                       "(default: the address the coordinator sees its requests come from).")


class BroadcastMember:
    """One process's part in broadcasts of one kind. serve=False fetches without relaying (a leech:
    for measurements only)."""

    def __init__(self, token: str, kind: str, work_dir: Path, settings: BroadcastSettings | None = None,
                 serve: bool = True, on_progress: Callable[[int, int], None] | None = None) -> None:
        self.settings = settings or BroadcastSettings()
        self.kind, self.work_dir, self.on_progress = kind, Path(work_dir) / kind, on_progress
        info = read_token(token)
        self.client = CoordinatorClient.for_token(token, request_timeout_s=30, retry_s=60, bearer=True)
        # A serving member of a run that speaks TLS gets a certificate for its own key with the hello.
        identity = MemberIdentity() if serve and info.tls_fp else None
        # A serving member signs what it serves with a key of its own the coordinator vouches for (evidence.py).
        signer = ChunkSigner() if serve else None
        try:
            hello = self.client.post("/v1/broadcast/hello",
                                     {**({"tls_public_key": identity.public_pem} if identity else {}),
                                      **({"chunk_key": signer.public_hex} if signer else {})})
        except CoordinatorError as e:
            raise BroadcastError(f"the coordinator at {info.coordinator} refused this member: {e}") from None
        if info.key_fp and fingerprint(hello["public_key"]) != info.key_fp:
            raise BroadcastError(f"the coordinator at {info.coordinator} signs with key {fingerprint(hello['public_key'])}"
                                 f", not the {info.key_fp} this token names: not this run's coordinator (or someone "
                                 "in between); nothing was fetched")
        if not info.key_fp:
            log.warning("this token names no signing key (made before keys existed): trusting the key the "
                        "coordinator sent; make a new token to pin it")
        self.public_key, self.run_id, self.may_publish = hello["public_key"], hello["run_id"], hello["publish"]
        self.key, self.holder_ttl_s = hello["broadcast_key"], float(hello["holder_ttl_s"])
        self.held: dict[int, Chunked | ChunkDir] = {}
        self.address = ""  # host:port as the coordinator names this member to others
        self._lock = threading.Lock()
        self._dirty = threading.Event()
        self._stop = threading.Event()
        # Kept across downloads: the peers of one version are mostly those of the next.
        self._conns = KeptConnections(self.settings.timeout_s, self.client.tls)
        # Peers that fetched the last version with this member: most fetch the next one too, so a download
        # opens its standing streams to them at once, before the coordinator's holder list names them.
        self._recent_peers: set[str] = set()
        # What earlier downloads taught about sources: those that delivered, and those that failed without
        # ever delivering (asked only when nobody else holds a chunk, for SUSPECT_DOWNLOADS downloads: an
        # honest peer that was slow once gets another chance). Bounded: oldest forgotten first.
        self._proven: dict[str, None] = {}
        self._suspects: dict[str, int] = {}  # source -> the download count when it was last suspected
        self._downloads = 0
        self._last_picker: SourcePicker | None = None
        self.server: ChunkServer | None = None
        if serve:
            # The server keeps what the member tells it to (retention below), plus a version read in the last
            # seconds, so a peer in the middle of a chunk is not cut off.
            self.server = ChunkServer(self.settings.host, self.settings.port, self.key, keep={kind: self.settings.keep},
                                      pin_s=5.0, upload_slots=self.settings.upload_slots)
            if identity is not None:
                self.server.tls = identity.server_context(hello["tls_cert"])
            signer.certify(hello["chunk_credential"])
            self.server.signer = signer
            self._announcer = threading.Thread(target=self._announce_loop, daemon=True, name="broadcast-have")
            self._announcer.start()

    # ---- trust -------------------------------------------------------------------------------------
    def verified(self, envelope: dict) -> dict:
        """The manifest inside a signed envelope, or BroadcastError if anything about it is off."""
        try:
            payload = {k: envelope[k] for k in ("run_id", "kind", "manifest")}
            verify(self.public_key, payload, str(envelope["signature"]))
        except (KeyError, TypeError) as e:
            raise BroadcastError(f"unsigned or malformed manifest (missing {e}); refused") from None
        except SignatureError as e:
            raise BroadcastError(f"{self.kind} manifest refused: {e}") from None
        manifest = payload["manifest"]
        if payload["run_id"] != self.run_id or payload["kind"] != self.kind:
            raise BroadcastError(f"manifest of {payload['run_id']}/{payload['kind']} where {self.run_id}/{self.kind} "
                                 "was asked for; refused")
        try:
            check_manifest(manifest)
        except TransferError as e:
            raise BroadcastError(str(e)) from None
        if manifest.get("root") != root_hash(manifest["chunks"]):
            raise BroadcastError("the manifest's root hash does not match its chunks; refused")
        return manifest

    # ---- versions ----------------------------------------------------------------------------------
    def manifest(self, version: int | None = None) -> dict:
        """The signed manifest of `version`, or of the newest version (BroadcastError if none)."""
        try:
            if version is not None:
                return self.verified(self.client.post("/v1/broadcast/manifest", {"kind": self.kind,
                                                                                 "version": version})["envelope"])
            answer = self.client.post("/v1/broadcast/wait", {"kind": self.kind, "after": -1})
        except CoordinatorError as e:
            raise BroadcastError(str(e)) from None
        if answer.get("status") != "ok":
            raise BroadcastError(f"no {self.kind} version has been published yet")
        return self.verified(answer["envelope"])

    def wait_newer(self, after: int, timeout_s: float) -> dict | None:
        """Long-polls the coordinator for a version above `after`: its manifest, or None at timeout_s."""
        found = self._wait_newer(after, timeout_s)
        return found[0] if found else None

    def _wait_newer(self, after: int, timeout_s: float) -> tuple[dict, list[dict]] | None:
        """wait_newer's manifest and who held the version when the coordinator answered (unsigned: a hint
        for the first choice of sources, every chunk is checked anyway)."""
        give_up = time.monotonic() + timeout_s
        while not self._stop.is_set():
            try:
                answer = self.client.post("/v1/broadcast/wait", {"kind": self.kind, "after": after})
            except CoordinatorError as e:
                raise BroadcastError(str(e)) from None
            if answer.get("status") == "ok":
                holders = answer.get("holders")
                return self.verified(answer["envelope"]), holders if isinstance(holders, list) else []
            if time.monotonic() > give_up:
                return None
        return None

    def publish(self, version: int, tensors: dict[str, torch.Tensor], meta: dict | None = None) -> dict:
        """Publishes `version` of the kind (this member must hold the publish right) and serves it."""
        if not self.may_publish:
            raise BroadcastError("this token has no publish right; ask the run's operator for one (token create --publish)")
        if self.server is None:
            raise BroadcastError("a publisher must serve its versions (serve=True)")
        if version in self.held:
            raise BroadcastError(f"publish refused: this member already holds {self.kind} version {version}; "
                                 "versions only go up")
        chunked = lay_out(version, tensors, meta, chunk_bytes=int(self.settings.chunk_mb * (1 << 20)))
        body = {"kind": self.kind, "manifest": chunked.manifest, "port": self.server.port,
                "host": self.settings.advertise_host}
        # Served before it is published (the coordinator names this member as a holder at once), announced
        # by this member only after (a `have` of a version the coordinator does not know is refused).
        self.server.publish(chunked, self.kind)
        try:
            answer = self.client.post("/v1/broadcast/publish", body)
            if answer["root"] != root_hash(chunked.manifest["chunks"]):
                raise BroadcastError("the coordinator signed another root hash than this member's; not served")
            signed = self.verified(answer["envelope"])
            if signed["version"] != version or signed["root"] != answer["root"]:
                raise BroadcastError("the coordinator signed another version than this member published; not served")
        except (CoordinatorError, BroadcastError, KeyError) as e:
            self.server.forget(self.kind, version)
            raise BroadcastError(f"publish refused: {e}") from None
        self._hold(version, chunked)
        log.info("%s version %d published: %.1f MB in %d chunks, root %s", self.kind, version,
                 chunked.manifest["total_bytes"] / 1e6, len(chunked.manifest["chunks"]), answer["root"][:12])
        return signed

    def fetch(self, version: int | None = None, only: Callable[[dict], bool] | None = None,
              manifest: dict | None = None, holders: list[dict] | None = None) -> tuple[ChunkDir, FetchReport]:
        """Fetches `version` (default the newest) from whoever holds it, verified, into the work dir; a
        restarted fetch keeps the verified chunks already there. only(holder): restricts the sources
        (holder: {address, origin}), for measurements of fixed topologies. holders: who held it a moment
        ago, as the coordinator answered a wait (the download starts from it instead of asking again)."""
        manifest = manifest or self.manifest(version)
        version = int(manifest["version"])
        started = time.monotonic()
        target = ChunkDir(self.work_dir / f"v{version:08d}", manifest)
        report = FetchReport(version, manifest["total_bytes"], len(manifest["chunks"]))
        report.resumed_chunks = target.resume()
        if self.server is not None:
            self._hold(version, target)
        streamed = self.settings.stream and manifest["total_bytes"] <= self.settings.stream_below_mb * (1 << 20)
        view = HolderView(self, version, only, holders, guessed=self._recent_peers if streamed else set())
        done = [len(target.held())]

        def verified_one(index: int) -> None:
            self._dirty.set()
            done[0] += 1
            if self.on_progress:
                self.on_progress(done[0], target.chunks)

        def bad(source: str, index: int, why: str, served: Served) -> None:
            report = {"kind": self.kind, "version": version, "source": source, "chunk": index, "reason": why}
            digest = sha256_hex(served.data)
            try:  # the source's own signed word on these bytes is what lets the coordinator act on the report
                if served.proof is None:
                    raise EvidenceError("the source signed nothing")
                served.proof.check(self.public_key, self.run_id, self.kind, version, index, digest)
                report["evidence"] = {**served.proof.as_json(), "sha256": digest}
                proven = "with its signed statement"
            except EvidenceError as e:
                proven = f"without evidence ({e}): a failed transfer, not a ban"
            log.warning("%s %d: %s sent a bad chunk %d (%s); reported to the coordinator %s", self.kind, version,
                        source, index, why, proven)
            try:
                self.client.post("/v1/broadcast/report", report, retry=False)
            except CoordinatorError as e:
                log.warning("could not report %s: %s", source, e)

        s = self.settings
        self._downloads += 1
        if self._last_picker is not None:  # what the last download's requests still in flight came to
            self._learn(self._last_picker)
        picker = SourcePicker(s.streams_per_source, s.max_failures, proven=set(self._proven),
                              suspects={a for a, when in self._suspects.items()
                                        if self._downloads - when <= SUSPECT_DOWNLOADS})
        try:
            Download(lambda src, path, conns, first: get_chunk(self.key, s.timeout_s, src, path, conns,
                                                               first_byte_s=first), target, self.kind,
                     view, picker, report, streams=s.streams, first_byte_s=s.first_byte_s,
                     stall_s=s.stall_s, on_verified=verified_one, on_bad=bad, timeout_s=s.timeout_s,
                     seeders=lambda: view.origins, tls=self.client.tls, conns=self._conns,
                     wait_s=s.standing_wait_s,
                     stream=(lambda src, path, conns, size_of, first: stream_chunks(self.key, s.timeout_s, src, path,
                                                                                    conns, size_of, first))
                     if streamed else None).run()
        except TransferError as e:
            raise BroadcastError(f"{e}; the {len(target.held())} verified chunks stay in {target.directory} "
                                 "for the next try") from None
        finally:
            view.stop()
            self._recent_peers = set(view.current) - view.origins
            self._learn(picker)
            self._last_picker = picker
        report.seconds = time.monotonic() - started
        self._dirty.set()
        self._retire()
        return target, report

    def _learn(self, picker: SourcePicker, keep: int = 4096) -> None:
        """Remembers which sources delivered in a download and which failed without delivering."""
        for source, stats in list(picker.stats.items()):
            if stats.rate is not None:
                self._suspects.pop(source, None)
                self._proven.pop(source, None)
                self._proven[source] = None
            elif stats.failures and source not in self._proven:
                # A request still in flight when its download ended is judged by how it ends: the picker
                # is read again before the next download. (Merely in flight proves nothing: a standing
                # request waits at an honest peer that had nothing new, and ends 'busy'.)
                self._suspects.pop(source, None)
                self._suspects[source] = self._downloads
        for memory in (self._proven, self._suspects):
            while len(memory) > keep:
                del memory[next(iter(memory))]

    def follow(self, on_version: Callable[[ChunkDir, FetchReport], None] | None = None,
               only: Callable[[dict], bool] | None = None,
               on_announced: Callable[[dict], None] | None = None,
               on_failed: Callable[[dict, BroadcastError], None] | None = None) -> None:
        """A relay: fetches every new version as it is announced (the newest, skipping any it fell behind
        on), serves it, keeps the last `keep`. on_announced(manifest) runs when a version is announced,
        before its download (its manifest is signed: the version is real); on_version(target, report) when
        it is complete, on_failed(manifest, error) when its download gave up. With settings.follow_overlap
        above 1 up to that many downloads run at once, each on its own thread, and their callbacks may run
        concurrently and out of version order. Returns when stop() is called."""
        newest = max(self.held, default=-1)
        running: list[threading.Thread] = []  # the downloads under way, oldest first
        while not self._stop.is_set():
            running = [t for t in running if t.is_alive()]
            if len(running) >= self.settings.follow_overlap:
                running[0].join(timeout=0.5)
                continue
            try:
                found = self._wait_newer(newest, timeout_s=3600)
            except BroadcastError as e:  # the coordinator gone for a while: a relay outlives it
                log.warning("waiting for a new %s version: %s; trying again in 5 s", self.kind, e)
                self._stop.wait(5)
                continue
            if found is None:
                continue
            manifest, holders = found
            newest = int(manifest["version"])  # the next wait is for a newer one (any between are skipped)
            if on_announced:
                on_announced(manifest)
            download = threading.Thread(target=self._follow_one, args=(manifest, holders, only, on_version, on_failed),
                                        name=f"follow-{self.kind}-{newest}", daemon=True)
            download.start()
            running.append(download)
            if self.settings.follow_overlap == 1:
                download.join()  # one at a time: the caller's callbacks never run concurrently
        for download in running:  # stopped: each ends at its next chunk or timeout
            download.join(timeout=self.settings.timeout_s)

    def _follow_one(self, manifest: dict, holders: list[dict], only, on_version, on_failed) -> None:
        try:
            target, report = self.fetch(manifest=manifest, only=only, holders=holders)
        except BroadcastError as e:
            log.warning("%s %d not fetched: %s", self.kind, manifest["version"], e)
            if on_failed:
                on_failed(manifest, e)
            return
        if on_version:
            on_version(target, report)

    # ---- holding and announcing --------------------------------------------------------------------
    def _hold(self, version: int, item: Chunked | ChunkDir) -> None:
        with self._lock:
            self.held[version] = item
        if self.server is not None:
            self.server.publish(item, self.kind)
        self._dirty.set()

    def _retire(self) -> None:
        """Keeps the newest `keep` versions: a complete newer version retires the oldest."""
        with self._lock:
            complete = sorted(v for v, item in self.held.items() if not isinstance(item, ChunkDir) or item.complete)
            old = [v for v in self.held if v < (complete[-self.settings.keep] if len(complete) >= self.settings.keep
                                                else -1)]
            retired = [self.held.pop(v) for v in old]
        for version, item in zip(old, retired):
            if self.server is not None:
                self.server.forget(self.kind, version)
            if isinstance(item, ChunkDir):
                item.remove()
            log.debug("%s %d retired (keeping the newest %d)", self.kind, version, self.settings.keep)

    def _announce_loop(self) -> None:
        last, announced = 0.0, set()
        while not self._stop.is_set():
            due = self._dirty.wait(0.25) or time.monotonic() - last > self.holder_ttl_s / 3
            if not due:
                continue
            with self._lock:
                new = not set(self.held) <= announced
            if not new:  # a version just begun goes out at once: peers send their standing requests here
                time.sleep(max(0.0, last + 0.1 - time.monotonic()))  # at most ten a second, however fast chunks come
            self._dirty.clear()
            last = time.monotonic()
            with self._lock:
                held = dict(self.held)
            announced = set(held)
            for version, item in held.items():
                complete = not isinstance(item, ChunkDir) or item.complete
                body = {"kind": self.kind, "version": version, "port": self.server.port,
                        "host": self.settings.advertise_host, "origin": isinstance(item, Chunked),
                        "chunks": "all" if complete else base64.b64encode(item.bitmap()).decode(),
                        "served_bytes": self.server.served.get((self.kind, version), 0)}
                try:
                    self.address = self.client.post("/v1/broadcast/have", body, retry=False)["address"]
                except CoordinatorError as e:
                    if e.status == 404:  # the coordinator no longer keeps it: stop offering it
                        with self._lock:
                            self.held.pop(version, None)
                    elif e.status is not None:
                        log.warning("%s %d: have refused: %s", self.kind, version, e)

    def complete_copies(self, version: int) -> int:
        """How many other members hold a complete verified copy of `version` (as the coordinator knows)."""
        answer = self.client.post("/v1/broadcast/holders", {"kind": self.kind, "version": version})
        return sum(h["chunks"] == "all" and h["address"] != self.address for h in answer["holders"])

    def served_bytes(self) -> int:
        return sum(n for (kind, _), n in self.server.served.items() if kind == self.kind) if self.server else 0

    def stop(self) -> None:
        self._stop.set()
        if self.server is not None:
            self.server.stop()
        self._conns.close()
        self.client.close()
