"""One version's verified chunks on disk, whole or in part: what a download writes and what a relay serves.

The directory holds `manifest.json` and one `chunk_NNNNNN` file per verified chunk, each written to a
temporary name and renamed, so a chunk file is always whole. A restarted download re-checks the files
against the manifest's hashes and keeps the good ones (resume). Chunks are served from here as soon as
they are verified, so a member relays a version while it is still fetching it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from pathlib import Path

from elastic_mesh.transfer.chunks import tensors_from


class VersionRemoved(RuntimeError):
    """A chunk stored into a version removed meanwhile (retired: newer ones arrived). Not a source's
    fault, so not a TransferError (which marks its source failed): the download of it stops."""


class ChunkDir:
    def __init__(self, directory: Path, manifest: dict, expected: list[set[str]] | None = None) -> None:
        """expected[i]: the sha256 digests chunk i may have (several when sources of different bytes
        share one layout); by default the manifest's own."""
        self.directory, self.manifest = Path(directory), manifest
        self.version = int(manifest["version"])
        self.expected = expected or [{c["sha256"]} for c in manifest["chunks"]]
        self._held: set[int] = set()
        self._seeded: set[int] = set()  # taken from a seeder (not from a peer): the share this member relays
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # a chunk was stored: wakes a relay's waiting requests
        self.removed = False  # retired (newer versions came) while perhaps still being fetched
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "manifest.json").write_text(json.dumps(manifest))

    def _path(self, index: int) -> Path:
        return self.directory / f"chunk_{index:06d}"

    @property
    def chunks(self) -> int:
        return len(self.manifest["chunks"])

    def resume(self) -> int:
        """Keeps the chunks already on disk that match their hash (an earlier download's); returns how many."""
        kept = 0
        for index in range(self.chunks):
            path = self._path(index)
            if path.exists():
                if hashlib.sha256(path.read_bytes()).hexdigest() in self.expected[index]:
                    with self._lock:
                        self._held.add(index)
                    kept += 1
                else:
                    path.unlink()
        return kept

    def matches(self, index: int, data: bytes) -> bool:
        return len(data) == self.manifest["chunks"][index]["size"] and \
            hashlib.sha256(data).hexdigest() in self.expected[index]

    def put(self, index: int, data: bytes, seeded: bool = False) -> bool:
        """Stores a chunk that matches; False if another stream stored it first. seeded: it came from a
        seeder (a broadcast's origin), so this member is the one that relays it to its peers."""
        staging = self.directory / f".chunk_{index:06d}.{threading.get_ident()}.tmp"
        with self._lock:
            if index in self._held:
                return False
        try:
            if self.removed:
                raise FileNotFoundError(self.directory)
            staging.write_bytes(data)
            staging.replace(self._path(index))
        except FileNotFoundError:
            if self.removed:  # the download's end, not a fault: the caller stops fetching this version
                raise VersionRemoved(f"version {self.version} was retired while it was fetched (newer ones "
                                     "arrived)") from None
            raise
        with self._arrived:
            fresh = index not in self._held
            self._held.add(index)
            if fresh and seeded:
                self._seeded.add(index)
            self._arrived.notify_all()
        return fresh

    def wait_for_more(self, than: int, timeout_s: float) -> bool:
        """Whether more than `than` chunks are held, waiting up to timeout_s for another to arrive."""
        deadline = time.monotonic() + timeout_s
        with self._arrived:
            while len(self._held) <= than:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._arrived.wait(left)
            return True

    def wait_for_any(self, wanted: bytes, timeout_s: float) -> bool:
        """Whether some chunk in the bitmap `wanted` is held, waiting up to timeout_s for one to arrive."""
        deadline = time.monotonic() + timeout_s
        with self._arrived:
            while not any(bitmap_has(wanted, i) for i in self._held):
                left = deadline - time.monotonic()
                if left <= 0 or len(self._held) == self.chunks:
                    return False
                self._arrived.wait(left)
            return True

    def chunk(self, index: int) -> bytes | None:
        """A verified chunk's bytes, or None while it is not held (a relay still fetching)."""
        with self._lock:
            if index not in self._held:
                return None
        return self._path(index).read_bytes()

    def held(self) -> set[int]:
        with self._lock:
            return set(self._held)

    def seeded(self) -> set[int]:
        with self._lock:
            return set(self._seeded)

    @property
    def complete(self) -> bool:
        with self._lock:
            return len(self._held) == self.chunks

    def bitmap(self) -> bytes:
        bits = bytearray((self.chunks + 7) // 8)
        for index in self.held():
            bits[index // 8] |= 1 << (index % 8)
        return bytes(bits)

    def read_all(self) -> bytearray:
        blob = bytearray()
        for index in range(self.chunks):
            blob += self._path(index).read_bytes()
        return blob

    def tensors(self) -> dict:
        return tensors_from(self.manifest, self.read_all())

    def remove(self) -> None:
        """Deletes the version's files; a download still storing chunks into it stops (put raises)."""
        self.removed = True
        shutil.rmtree(self.directory, ignore_errors=True)


def bitmap_has(bitmap: bytes | None, index: int) -> bool:
    """Whether a holder's bitmap (None: it holds them all) has chunk `index`."""
    return bitmap is None or (index // 8 < len(bitmap) and bool(bitmap[index // 8] >> (index % 8) & 1))
