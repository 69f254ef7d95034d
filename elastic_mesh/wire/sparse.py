"""A sparse wire format for a flat fp32 tensor: the k largest magnitudes of every chunk, each value in a
few bits, each index packed (SparseLoCo's scheme, our encoding).

Per chunk of `chunk` values the k largest magnitudes are kept. Their magnitudes, ranked, fall into
2^(bits−1) bins of equal count; each bin is sent as one bf16 level (the mean magnitude of its values),
each value as its sign and its bin. Indices are sorted within their chunk and sent either at a fixed
width (12 bits for 4096: two per 3 bytes, the anchor's packing) or Rice-coded: the gaps between
consecutive indices (geometric-like, mean chunk/k) split into r low bits, sent at a fixed width, and
a quotient sent in unary, in a stream of its own so that decoding is a vectorised search for zeros
instead of a bit-serial parse. At chunk 4096, k 64, 2 bits: ~84 bytes a chunk Rice-coded against 116
fixed (fp32: 16384).

Decoding is deterministic: every member that decodes the same bytes gets the same floats, so members
that average decoded contributions in one order end bit-identical. Bytes come from peers: decoding
checks every field and length and raises ValueError, never reads out of bounds or returns a
non-finite value.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import numpy as np
import torch

MAGIC = b"SPR1"
_HEADER = struct.Struct("<4sqiiBBBxq")  # magic, elements, chunk, k, value bits, packing, rice r, -, unary bits
PACKINGS = ("fixed", "rice")
MAX_RICE_R = 30


def pack_bits(values: torch.Tensor, width: int) -> bytes:
    """Non-negative integers < 2^width, `width` bits each, little-endian bit order, padded to a byte."""
    if width == 0 or values.numel() == 0:
        return b""
    v = values.reshape(-1).to(torch.int64).numpy()
    bits = ((v[:, None] >> np.arange(width, dtype=np.int64)) & 1).astype(np.uint8)
    return np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def unpack_bits(data: bytes, count: int, width: int) -> torch.Tensor:
    """The inverse of pack_bits: `count` integers of `width` bits (int64)."""
    if width == 0 or count == 0:
        return torch.zeros(count, dtype=torch.int64)
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=count * width, bitorder="little")
    weights = (1 << np.arange(width, dtype=np.int64))
    return torch.from_numpy(bits.reshape(count, width).astype(np.int64) @ weights)


def _packed_size(count: int, width: int) -> int:
    return (count * width + 7) // 8


@dataclass(frozen=True)
class SparseCodec:
    """chunk: values per top-k selection; k: kept per chunk; bits: per kept value (its sign and
    2^(bits−1) magnitude levels); packing: of the indices, "fixed" or "rice"."""

    chunk: int = 4096
    k: int = 64
    bits: int = 2
    packing: str = "rice"

    def __post_init__(self) -> None:
        problem = sparse_settings_problem(self.chunk, self.k, self.bits, self.packing)
        if problem:
            raise ValueError(problem)

    @property
    def name(self) -> str:
        return f"sparse:chunk={self.chunk},k={self.k},bits={self.bits},packing={self.packing}"

    @classmethod
    def from_name(cls, name: str) -> "SparseCodec":
        match = re.fullmatch(r"sparse:chunk=(\d{1,9}),k=(\d{1,9}),bits=(\d),packing=(\w+)", name)
        if match is None:
            raise ValueError(f"{name[:100]!r} is not a sparse codec's name (sparse:chunk=C,k=K,bits=B,packing=P)")
        return cls(int(match[1]), int(match[2]), int(match[3]), match[4])

    @property
    def levels(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def index_width(self) -> int:
        return max(1, (self.chunk - 1).bit_length())

    def max_size(self, n: int) -> int:
        """The most bytes an encoding of n values can take: Rice coding at r = the index width costs
        width + 1 bits an index and never more (gaps are under the chunk), and the chosen r costs no more."""
        chunks = max(1, -(-n // self.chunk))
        indices = chunks * self.k
        index_bits = indices * (self.index_width + (self.packing == "rice"))
        return _HEADER.size + chunks * self.levels * 2 + _packed_size(indices, self.bits) + (index_bits + 7) // 8 + 1

    # ---- encoding ----------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 (n,) → uint8: the kept values of every chunk (see the module's docstring)."""
        x = x.detach().reshape(-1).float().cpu()
        n = x.numel()
        chunks = max(1, -(-n // self.chunk))
        padded = torch.zeros(chunks * self.chunk)
        padded[:n] = x
        table = padded.view(chunks, self.chunk)
        magnitude, index = table.abs().topk(self.k, dim=1, sorted=True)  # largest first
        # Bins of equal count by rank: each level is the mean magnitude of its bin, rounded to bf16.
        levels = magnitude.view(chunks, self.levels, self.k // self.levels).mean(dim=2).to(torch.bfloat16)
        rank_bin = torch.arange(self.k) * self.levels // self.k
        negative = table.gather(1, index) < 0
        codes = (negative.to(torch.int64) << (self.bits - 1)) | rank_bin
        order = index.argsort(dim=1)
        index, codes = index.gather(1, order), codes.gather(1, order)
        if self.packing == "fixed":
            rice_r, unary_bits, index_bytes = 0, 0, pack_bits(index, self.index_width)
        else:
            rice_r, unary_bits, index_bytes = _rice_encode(index)
        header = _HEADER.pack(MAGIC, n, self.chunk, self.k, self.bits, PACKINGS.index(self.packing), rice_r,
                              unary_bits)
        body = header + levels.view(torch.uint8).numpy().tobytes() + pack_bits(codes, self.bits) + index_bytes
        return torch.frombuffer(bytearray(body), dtype=torch.uint8)

    # ---- decoding ----------------------------------------------------------------------------------
    def decode(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        """uint8 → fp32 (n,), dense (zeros where nothing was kept). Raises ValueError for bytes that are
        not this codec's encoding of n values."""
        data = buf.numpy().tobytes() if isinstance(buf, torch.Tensor) else bytes(buf)
        if len(data) < _HEADER.size:
            raise ValueError(f"{len(data)} bytes: shorter than the {_HEADER.size}-byte header")
        magic, elements, chunk, k, bits, packing, rice_r, unary_bits = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise ValueError("not a sparse encoding (bad magic)")
        if (elements, chunk, k, bits) != (n, self.chunk, self.k, self.bits) or packing >= len(PACKINGS) or \
                PACKINGS[packing] != self.packing:
            raise ValueError(f"encoded as {elements} values, chunk {chunk}, k {k}, {bits} bits, packing #{packing}; "
                             f"expected {n} values and {self.name}")
        chunks = max(1, -(-n // chunk))
        indices = chunks * k
        offset = _HEADER.size
        level_bytes = chunks * self.levels * 2
        code_bytes = _packed_size(indices, bits)
        if self.packing == "fixed":
            index_bytes = _packed_size(indices, self.index_width)
        else:
            if rice_r > MAX_RICE_R or not 0 <= unary_bits <= 8 * len(data):
                raise ValueError(f"rice parameter {rice_r} or unary length {unary_bits} out of range")
            index_bytes = _packed_size(indices, rice_r) + (unary_bits + 7) // 8
        if len(data) != offset + level_bytes + code_bytes + index_bytes:
            raise ValueError(f"{len(data)} bytes where the header implies "
                             f"{offset + level_bytes + code_bytes + index_bytes}")
        levels = torch.frombuffer(bytearray(data[offset:offset + level_bytes]), dtype=torch.bfloat16).float()
        if not torch.isfinite(levels).all() or (levels < 0).any():
            raise ValueError("a magnitude level is negative or not finite")
        offset += level_bytes
        codes = unpack_bits(data[offset:offset + code_bytes], indices, bits).view(chunks, k)
        offset += code_bytes
        if self.packing == "fixed":
            index = unpack_bits(data[offset:], indices, self.index_width).view(chunks, k)
            if chunks and k > 1 and not bool((index[:, 1:] > index[:, :-1]).all()):
                raise ValueError("indices are not strictly increasing within a chunk")
        else:
            index = _rice_decode(data[offset:], chunks, k, rice_r, unary_bits)
        if bool((index >= chunk).any()):
            raise ValueError(f"an index is outside its chunk of {chunk}")
        magnitude = levels.view(chunks, self.levels).gather(1, codes & (self.levels - 1))
        values = torch.where((codes >> (bits - 1)) & 1 == 1, -magnitude, magnitude)
        out = torch.zeros(chunks, chunk)
        out.scatter_(1, index, values)
        return out.view(-1)[:n].clone()


def _rice_encode(index: torch.Tensor) -> tuple[int, int, bytes]:
    """Sorted indices per chunk (chunks, k) → (r, unary bits, remainders then unary stream)."""
    gaps = torch.cat([index[:, :1], index[:, 1:] - index[:, :-1] - 1], dim=1).reshape(-1)
    # The r that minimises the total: N·(r+1) bits of remainders and terminators, plus the quotients.
    costs = [gaps.numel() * (r + 1) + int((gaps >> r).sum()) for r in range(0, MAX_RICE_R + 1)]
    r = min(range(len(costs)), key=costs.__getitem__)
    quotient = gaps >> r
    remainder = gaps & ((1 << r) - 1)
    unary_bits = int(quotient.sum()) + gaps.numel()
    bits = np.ones(unary_bits, dtype=np.uint8)
    bits[(torch.cumsum(quotient + 1, 0) - 1).numpy()] = 0  # q ones, then the zero that ends the symbol
    unary = np.packbits(bits, bitorder="little").tobytes()
    return r, unary_bits, pack_bits(remainder, r) + unary


def _rice_decode(data: bytes, chunks: int, k: int, r: int, unary_bits: int) -> torch.Tensor:
    count = chunks * k
    remainder_bytes = _packed_size(count, r)
    remainder = unpack_bits(data[:remainder_bytes], count, r)
    bits = np.unpackbits(np.frombuffer(data[remainder_bytes:], dtype=np.uint8), count=unary_bits, bitorder="little")
    ends = torch.from_numpy(np.flatnonzero(bits == 0).astype(np.int64))
    if ends.numel() != count:
        raise ValueError(f"the unary stream ends {ends.numel()} symbols where {count} indices are expected")
    # Each quotient is under the stream's length in bits (bounded by the message): no overflow below.
    quotient = torch.diff(ends, prepend=torch.tensor([-1])) - 1
    gaps = ((quotient << r) | remainder).view(chunks, k)
    return torch.cumsum(gaps + 1, dim=1) - 1


def sparse_settings_problem(chunk: int, k: int, bits: int, packing: str) -> str | None:
    """Why these settings make no sparse codec (None: they do); shared with the config's validation."""
    if not 2 <= chunk <= 1 << 20:
        return f"sparse chunk {chunk} must be between 2 and {1 << 20}"
    if not 1 <= k <= chunk:
        return f"sparse k {k} must be between 1 and the chunk ({chunk})"
    if not 1 <= bits <= 4:
        return f"sparse value bits {bits} must be 1 to 4 (a sign and 2^(bits-1) magnitude levels)"
    if k % (1 << (bits - 1)):
        return f"sparse k {k} must be a multiple of the {1 << (bits - 1)} magnitude levels that {bits} bits give"
    if packing not in PACKINGS:
        return f"sparse index packing {packing!r} must be one of {', '.join(PACKINGS)}"
    return None
