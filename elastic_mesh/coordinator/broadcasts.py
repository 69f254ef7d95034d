"""Broadcast bookkeeping on the coordinator: signed versions, who holds which chunks, who served bad ones.

The coordinator never carries payload. A publisher sends a version's manifest (chunk hashes, layout);
the coordinator checks its shape, signs it with the run's key and keeps the newest `keep` versions of
each kind (in SQLite, so a restarted coordinator still knows them). Every process that holds chunks of
a version says so (`have`, a bitmap, renewed within `holder_ttl_s` or forgotten), and asks who holds
what (`holders`). A member that received a chunk that does not match the signed hash reports its
source. Evidence, not votes: a report bans only with the source's own signed statement that it sent
bytes whose hash is not the manifest's (transfer/evidence.py), and then it bans the token whose key
signed it, from serving that kind at all. A report without such evidence is an event and nothing
more, however many tokens make it (two colluding worker tokens once stopped a run by reporting the
trainer's address). Reports name a kept version and a bounded number of sources per token, so spam
cannot grow memory or the event log. A holder entry belongs to the token that made it: no token
overwrites another's.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import re
import threading
import time
from dataclasses import dataclass, field

from elastic_mesh.control.service import printable
from elastic_mesh.control.signing import RunSigner
from elastic_mesh.control.token import JoinToken
from elastic_mesh.coordinator.config import Refused
from elastic_mesh.coordinator.state import CoordinatorState
from elastic_mesh.transfer.chunks import TransferError, check_manifest, root_hash
from elastic_mesh.transfer.evidence import ChunkProof, EvidenceError

log = logging.getLogger(__name__)

KIND = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
MAX_HOLDERS_ANSWERED = 64
MAX_SOURCES_REPORTED = 8  # distinct sources one token may report per version (a download drops a bad one)


@dataclass
class Holder:
    address: str  # host:port of its chunk server
    token_id: str
    chunks: bytes | None  # bitmap of the chunks it holds, None: all of them
    origin: bool
    served_bytes: int
    seen: float  # time.monotonic() of its last `have`


@dataclass
class VersionHolders:
    holders: dict[str, Holder] = field(default_factory=dict)
    reports: dict[str, set[str]] = field(default_factory=dict)  # source address -> reporters' token ids
    banned: dict[str, str] = field(default_factory=dict)  # source address -> why


def bitmap_count(bitmap: bytes | None, chunks: int) -> int:
    if bitmap is None:
        return chunks
    return sum(bin(b).count("1") for b in bitmap)


class Broadcasts:
    def __init__(self, state: CoordinatorState, signer: RunSigner, run_id: str, lock: threading.RLock,
                 changed: threading.Condition, keep: int, holder_ttl_s: float) -> None:
        self.state, self.signer, self.run_id, self.lock, self.changed = state, signer, run_id, lock, changed
        self.keep, self.holder_ttl_s = keep, holder_ttl_s
        self._holders: dict[tuple[str, int], VersionHolders] = {}
        with state.transaction():
            state.db.execute("CREATE TABLE IF NOT EXISTS broadcasts (kind TEXT NOT NULL, version INTEGER NOT NULL, "
                             "envelope TEXT NOT NULL, publisher TEXT NOT NULL, published_at REAL NOT NULL, "
                             "PRIMARY KEY (kind, version))")
            # Tokens proven to have served bad chunks of a kind (their own signed statements): they serve
            # that kind no more, in this coordinator's life or the next.
            state.db.execute("CREATE TABLE IF NOT EXISTS broadcast_bans (kind TEXT NOT NULL, token_id TEXT NOT NULL, "
                             "why TEXT NOT NULL, PRIMARY KEY (kind, token_id))")

    # ---- versions ----------------------------------------------------------------------------------
    def publish(self, token: JoinToken, body: dict, peer: str) -> dict:
        if not token.publish:
            raise Refused(403, f"token {token.token_id} has no publish right; ask the run's operator for one "
                               "(token create --publish)")
        kind = _kind(body)
        try:
            manifest = check_manifest(body.get("manifest"))
        except TransferError as e:
            raise Refused(400, str(e)) from None
        version = int(manifest["version"])
        manifest = {**manifest, "kind": kind, "root": root_hash(manifest["chunks"])}
        payload = {"run_id": self.run_id, "kind": kind, "manifest": manifest}
        envelope = {**payload, "signature": self.signer.sign(payload)}
        with self.lock, self.state.transaction():
            newest = self._newest(kind)
            if newest is not None and version <= newest:
                raise Refused(409, f"{kind} version {version} is not newer than the published {newest}; "
                                   "versions only go up")
            self.state.db.execute("INSERT INTO broadcasts VALUES (?, ?, ?, ?, ?)",
                                  (kind, version, json.dumps(envelope), token.token_id, time.time()))
            stale = self.state.db.execute("SELECT version FROM broadcasts WHERE kind = ? ORDER BY version DESC "
                                          "LIMIT -1 OFFSET ?", (kind, self.keep)).fetchall()
            for (old,) in stale:
                self.state.db.execute("DELETE FROM broadcasts WHERE kind = ? AND version = ?", (kind, old))
                self._holders.pop((kind, old), None)
            self.state.event(f"{kind} version {version} published ({manifest['total_bytes'] / 1e6:.1f} MB in "
                             f"{len(manifest['chunks'])} chunks, root {manifest['root'][:12]})")
            self.changed.notify_all()
        log.info("%s version %d published by token %s: %.1f MB, root %s", kind, version, token.token_id,
                 manifest["total_bytes"] / 1e6, manifest["root"][:12])
        if body.get("port"):
            self.have(token, {**body, "version": version, "chunks": "all", "origin": True}, peer)
        # The signed envelope comes back with the answer: the publisher needs no second round trip for it.
        return {"status": "ok", "version": version, "root": manifest["root"], "envelope": envelope}

    def _newest(self, kind: str) -> int | None:
        row = self.state.db.execute("SELECT MAX(version) FROM broadcasts WHERE kind = ?", (kind,)).fetchone()
        return row[0]

    def envelope(self, kind: str, version: int | None = None, after: int = -1) -> dict | None:
        """The signed manifest of `version`, or of the newest version above `after`."""
        with self.lock:
            if version is not None:
                row = self.state.db.execute("SELECT envelope FROM broadcasts WHERE kind = ? AND version = ?",
                                            (kind, version)).fetchone()
            else:
                row = self.state.db.execute("SELECT envelope FROM broadcasts WHERE kind = ? AND version > ? "
                                            "ORDER BY version DESC LIMIT 1", (kind, after)).fetchone()
        return json.loads(row[0]) if row else None

    def manifest(self, body: dict) -> dict:
        kind, version = _kind(body), int(body["version"])
        found = self.envelope(kind, version)
        if found is None:
            with self.lock:
                held = [v for (v,) in self.state.db.execute(
                    "SELECT version FROM broadcasts WHERE kind = ? ORDER BY version", (kind,))]
            raise Refused(404, f"no {kind} version {version} (kept: {held or 'none'})")
        return {"status": "ok", "envelope": found}

    def wait_answer(self, body: dict) -> dict | None:
        """For the long-poll: the newest version above `after` with who holds it now (a follower starts
        its download from that, without another round trip), or None (keep waiting)."""
        kind = _kind(body)
        found = self.envelope(kind, after=int(body.get("after", -1)))
        if not found:
            return None
        return {"status": "ok", "envelope": found,
                "holders": self.holders({"kind": kind, "version": found["manifest"]["version"]})["holders"]}

    # ---- holders -----------------------------------------------------------------------------------
    def have(self, token: JoinToken, body: dict, peer: str) -> dict:
        kind, version, port = _kind(body), int(body["version"]), int(body["port"])
        if not 0 < port < 65536:
            raise Refused(400, f"port {port} is not a port")
        host = str(body.get("host") or peer)[:200]
        address = f"{host}:{port}"
        chunks = body.get("chunks")
        bitmap = None if chunks == "all" else base64.b64decode(str(chunks), validate=True)
        with self.lock:
            if self.envelope(kind, version) is None:
                raise Refused(404, f"no {kind} version {version} is kept; fetch a newer one")
            entry = self._holders.setdefault((kind, version), VersionHolders())
            if address in entry.banned:
                raise Refused(403, f"{address} is banned from serving {kind} {version}: {entry.banned[address]}")
            why = self._token_ban(kind, token.token_id)
            if why is not None:
                raise Refused(403, f"token {token.token_id} is banned from serving {kind}: {why}")
            owner = entry.holders.get(address)
            if owner is not None and owner.token_id != token.token_id and \
                    time.monotonic() - owner.seen <= self.holder_ttl_s:
                raise Refused(409, f"{address} is named as a holder of {kind} {version} by another token; a token "
                                   "may name only the chunk servers it runs")
            # A token names at most max_nodes holders: one leaked token cannot fill the holder lists with
            # addresses that waste everyone's time-outs.
            mine = [a for a, h in entry.holders.items() if h.token_id == token.token_id and
                    time.monotonic() - h.seen <= self.holder_ttl_s]
            if address not in mine and len(mine) >= token.max_nodes:
                raise Refused(403, f"token {token.token_id} already names {len(mine)} holder(s) of {kind} {version}, "
                                   f"its cap (max_nodes {token.max_nodes}); give each worker its own token, or one "
                                   "with --max-nodes")
            origin = bool(body.get("origin")) and token.publish
            entry.holders[address] = Holder(address, token.token_id, bitmap, origin,
                                            int(body.get("served_bytes", 0)), time.monotonic())
            self.changed.notify_all()
        return {"status": "ok", "address": address}

    def holders(self, body: dict) -> dict:
        kind, version = _kind(body), int(body["version"])
        now = time.monotonic()
        with self.lock:
            entry = self._holders.get((kind, version), VersionHolders())
            for address in [a for a, h in entry.holders.items() if now - h.seen > self.holder_ttl_s]:
                del entry.holders[address]
            live = list(entry.holders.values())
        if len(live) > MAX_HOLDERS_ANSWERED:  # a fair sample, so no holder is everyone's first choice
            live = random.sample(live, MAX_HOLDERS_ANSWERED)
        return {"status": "ok", "holders": [
            {"address": h.address, "origin": h.origin,
             "chunks": "all" if h.chunks is None else base64.b64encode(h.chunks).decode()} for h in live]}

    def report(self, token: JoinToken, body: dict) -> dict:
        """A member's report of a bad chunk from `source`: an event; a ban only with evidence (see above)."""
        kind, version, source = _kind(body), int(body["version"]), printable(body["source"], 100)
        chunk, reason = int(body.get("chunk", -1)), printable(body.get("reason", ""), 160)
        with self.lock, self.state.transaction():
            envelope = self.envelope(kind, version)
            if envelope is None:
                raise Refused(404, f"no {kind} version {version} is kept: a report must be about a published version")
            entry = self._holders.setdefault((kind, version), VersionHolders())
            reporters = entry.reports.get(source, set())
            if token.token_id in reporters:
                return {"status": "ok", "banned": source in entry.banned}  # said once; said again adds nothing
            mine = sum(1 for who in entry.reports.values() if token.token_id in who)
            if mine >= MAX_SOURCES_REPORTED:
                raise Refused(403, f"token {token.token_id} already reported {mine} sources of {kind} {version}, "
                                   f"the most one token may")
            entry.reports.setdefault(source, set()).add(token.token_id)
            said = (f"{kind} {version}: chunk {chunk} from {source} did not match its signed hash (reported by token "
                    f"{token.token_id}: {reason})")
            try:
                liar = self._proven_liar(kind, version, chunk, envelope["manifest"], body.get("evidence"))
            except EvidenceError as e:
                self.state.event(f"{said}; no ban: {printable(e, 160)}")
                return {"status": "ok", "banned": source in entry.banned, "proven": False, "detail": str(e)}
            why = f"signed chunk {chunk} of {kind} {version} with a hash that is not the manifest's (served at {source})"
            self._ban(kind, liar, why)
            self.state.event(f"{said}; token {liar} banned from serving {kind}: its own signed statement")
            log.warning("%s %d: token %s banned from serving %s: %s", kind, version, liar, kind, why)
        return {"status": "ok", "banned": True, "proven": True, "token_id": liar}

    def _proven_liar(self, kind: str, version: int, chunk: int, manifest: dict, evidence: object) -> str:
        """The token whose key signed that it served chunk `chunk` of this version as bytes hashing to
        something other than the manifest's hash; EvidenceError when the evidence does not show that."""
        if evidence is None:
            raise EvidenceError("the report carries no signed statement of the source")
        if not 0 <= chunk < len(manifest["chunks"]):
            raise EvidenceError(f"chunk {chunk} is not a chunk of {kind} {version}")
        signed = str(evidence.get("sha256", "")) if isinstance(evidence, dict) else ""
        if len(signed) != 64 or any(c not in "0123456789abcdef" for c in signed):
            raise EvidenceError("the evidence names no sha256 of the bytes received")
        if signed == manifest["chunks"][chunk]["sha256"]:
            raise EvidenceError("the source signed the manifest's own hash: its statement is of good bytes")
        return ChunkProof.from_json(evidence).check(self.signer.public_hex, self.run_id, kind, version, chunk, signed)

    def _token_ban(self, kind: str, token_id: str) -> str | None:
        row = self.state.db.execute("SELECT why FROM broadcast_bans WHERE kind = ? AND token_id = ?",
                                    (kind, token_id)).fetchone()
        return row[0] if row else None

    def _ban(self, kind: str, token_id: str, why: str) -> None:
        """Under the lock: `token_id` serves `kind` no more; its holder entries go from every version."""
        self.state.db.execute("INSERT OR IGNORE INTO broadcast_bans VALUES (?, ?, ?)", (kind, token_id, why))
        for (k, _), entry in self._holders.items():
            if k != kind:
                continue
            for address in [a for a, h in entry.holders.items() if h.token_id == token_id]:
                entry.banned[address] = why
                del entry.holders[address]

    # ---- status ------------------------------------------------------------------------------------
    def summary(self) -> list[dict]:
        now = time.monotonic()
        with self.lock:
            rows = self.state.db.execute("SELECT kind, version, envelope, published_at FROM broadcasts "
                                         "ORDER BY kind, version").fetchall()
            out = []
            for kind, version, envelope, published_at in rows:
                manifest = json.loads(envelope)["manifest"]
                entry = self._holders.get((kind, version), VersionHolders())
                live = [h for h in entry.holders.values() if now - h.seen <= self.holder_ttl_s]
                n = len(manifest["chunks"])
                out.append({"kind": kind, "version": version, "published_at": published_at,
                            "bytes": manifest["total_bytes"], "chunks": n, "root": manifest["root"][:16],
                            "holders": len(live), "complete": sum(bitmap_count(h.chunks, n) == n for h in live),
                            "bytes_served": sum(h.served_bytes for h in live), "banned": sorted(entry.banned)})
            return out


def _kind(body: dict) -> str:
    kind = str(body.get("kind", ""))
    if not KIND.fullmatch(kind):
        raise Refused(400, f"kind {kind[:40]!r} must be 1-32 of a-z, 0-9, _ and - (starting with a letter or digit)")
    return kind
