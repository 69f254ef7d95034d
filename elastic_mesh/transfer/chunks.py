"""Named tensors laid out back to back in fixed-size chunks, and the manifest that describes them.

The manifest (JSON) names every tensor (dtype, shape, offset) and lists every chunk's size and sha256, so a
receiver checks each chunk on its own, from any source, before it uses a byte of it. Nothing is pickled:
tensors travel as their raw bytes. What the tensors mean is the caller's business; this module only knows
a version number, the caller's free-form `meta`, and bytes.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Callable

import torch

CHUNK_BYTES = 4 << 20
DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8)}


class TransferError(RuntimeError):
    """Chunks could not be served or fetched; the message says which chunk or source and why."""


class SourceBusy(TransferError):
    """The source's upload slots are all taken (HTTP 503): not a failure; ask elsewhere or later."""


class NothingYet(SourceBusy):
    """A relay still fetching got none of the wanted chunks while the request waited (HTTP 204)."""


@dataclass
class Chunked:
    """One version of something, laid out: its manifest and the bytes the manifest describes."""

    version: int
    manifest: dict
    blob: bytes | memoryview

    def chunk(self, index: int) -> bytes | memoryview:
        size = self.manifest["chunk_bytes"]
        return self.blob[index * size:(index + 1) * size]


def check_dtypes(tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        if str(tensor.dtype) not in DTYPES:
            raise TypeError(f"tensor {name} has dtype {tensor.dtype}; supported: {sorted(DTYPES)}")


def lay_out(version: int, tensors: dict[str, torch.Tensor], meta: dict | None = None,
            chunk_bytes: int = CHUNK_BYTES) -> Chunked:
    """Lays the tensors out back to back (CPU, contiguous) and hashes every chunk: one copy, made by
    torch without the GIL, and chunks hashed in place (bytes() + join + slicing made four copies
    under the GIL)."""
    check_dtypes(tensors)
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
    manifest = {"version": version, "chunk_bytes": chunk_bytes, "total_bytes": len(blob), "tensors": entries,
                "chunks": chunks, "meta": meta or {}}
    return Chunked(version, manifest, blob)


class Deferred:
    """Tensors laid out and hashed when a receiver first asks for them, not when they are published. A
    DiLoCo node, for one, publishes its whole state (16 bytes a parameter) at every round while it
    trains, and most versions are never fetched: laid out at once, each took ~0.2 s of a core per
    100 MB here. The tensors must be copies that nothing writes again; their dtypes are checked now, so
    a bad one fails the publisher, not a receiver. `transform` rewrites the laid-out result once (the
    seam through which a test serves corrupted bytes)."""

    def __init__(self, version: int, tensors: dict[str, torch.Tensor], meta: dict | None = None,
                 chunk_bytes: int = CHUNK_BYTES, transform: Callable[[Chunked], Chunked] | None = None) -> None:
        check_dtypes(tensors)
        self.version = version
        self._args: tuple | None = (tensors, meta, chunk_bytes, transform)
        self._built: Chunked | None = None
        self._lock = threading.Lock()

    def get(self) -> Chunked:
        with self._lock:  # concurrent first requests build it once
            if self._built is None:
                tensors, meta, chunk_bytes, transform = self._args
                built = lay_out(self.version, tensors, meta, chunk_bytes)
                self._built, self._args = transform(built) if transform else built, None  # the copies go
            return self._built


def root_hash(chunks: list[dict]) -> str:
    """One hash over every chunk's hash, in order: names a version's bytes in one line (logs, dashboard)."""
    return hashlib.sha256("".join(c["sha256"] for c in chunks).encode()).hexdigest()


_HEX = frozenset("0123456789abcdef")
MAX_CHUNKS = 1 << 20


def check_manifest(manifest: object) -> dict:
    """A manifest from someone else, checked for shape before any of it is used: a chunk list that adds
    up to total_bytes in chunk_bytes pieces, sha256 hex digests, tensors of known dtypes whose bytes lie
    inside the blob. Raises TransferError naming the first fault."""
    def fail(why: str):
        raise TransferError(f"malformed manifest: {why}")
    if not isinstance(manifest, dict):
        fail("not a JSON object")
    try:
        version, size, total = int(manifest["version"]), int(manifest["chunk_bytes"]), int(manifest["total_bytes"])
        chunks, tensors = manifest["chunks"], manifest["tensors"]
    except (KeyError, TypeError, ValueError) as e:
        fail(f"missing or non-integer field ({e})")
    if version < 0 or size < 1 or total < 0 or not isinstance(chunks, list) or not isinstance(tensors, list):
        fail("negative version or sizes, or chunks/tensors not lists")
    if len(chunks) > MAX_CHUNKS or len(chunks) != -(-total // size):
        fail(f"{len(chunks)} chunks cannot hold {total} bytes in chunks of {size}")
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, dict) or chunk.get("size") != min(size, total - i * size):
            fail(f"chunk {i} has the wrong size")
        digest = chunk.get("sha256")
        if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _HEX:
            fail(f"chunk {i} has no sha256 hex digest")
    for entry in tensors:
        try:
            dtype, offset, nbytes = DTYPES[entry["dtype"]], int(entry["offset"]), int(entry["nbytes"])
            count = 1
            for dim in entry["shape"]:
                count *= int(dim)
            str(entry["name"])
        except (KeyError, TypeError, ValueError):
            fail(f"tensor entry {str(entry)[:80]} lacks a name, a known dtype, a shape, an offset or nbytes")
        if offset < 0 or offset + nbytes > total or nbytes != count * dtype.itemsize:
            fail(f"tensor {entry['name']!r} does not lie inside the payload or its size does not match its shape")
    return manifest


def tensors_from(manifest: dict, blob: bytes | bytearray) -> dict[str, torch.Tensor]:
    """The named tensors a manifest describes, read from its (verified) bytes."""
    out = {}
    for entry in manifest["tensors"]:
        raw = bytearray(blob[entry["offset"]:entry["offset"] + entry["nbytes"]])
        dtype = DTYPES[entry["dtype"]]
        tensor = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        out[entry["name"]] = tensor.reshape(entry["shape"])
    return out


def layout_of(manifest: dict) -> dict:
    """A manifest without its chunk hashes: what sources of different bytes must still agree on."""
    return {**manifest, "chunks": [c["size"] for c in manifest["chunks"]]}
