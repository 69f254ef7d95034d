"""Wire formats for the all-reduce: what a chunk of fp32 values becomes on the wire, and back.

Int8 uses one scale per block of 64 values (bf16, rounded up so no value clips), which keeps the
relative error of one quantization near 0.6% for Gaussian data at 3.88× fewer bytes than fp32.
Decoding is deterministic, so every member that decodes the same bytes gets the same floats.
"""

from __future__ import annotations

import torch

from elastic_mesh.wire.sparse import SparseCodec

BLOCK = 64  # values per int8 scale; also the granularity every codec pads chunks to


class Codec:
    name = "none"
    bytes_per_value = 4.0

    def encoded_size(self, n: int) -> int:
        return 4 * n

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 (n,) with n a multiple of BLOCK → uint8 (encoded_size(n),)."""
        return x.contiguous().view(torch.uint8)

    def decode(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        return buf.view(torch.float32).clone()


class BF16Codec(Codec):
    name = "bf16"
    bytes_per_value = 2.0

    def encoded_size(self, n: int) -> int:
        return 2 * n

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16).view(torch.uint8)

    def decode(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        return buf.view(torch.bfloat16).float()


class Int8Codec(Codec):
    name = "int8"
    bytes_per_value = 1 + 2 / BLOCK

    def encoded_size(self, n: int) -> int:
        return n + 2 * (n // BLOCK)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        blocks = x.view(-1, BLOCK)
        amax = torch.maximum(torch.amax(blocks, dim=1), torch.amin(blocks, dim=1).neg_())
        # Round the scale *up* to a bf16 value (clear the low 16 bits after adding just under one ulp),
        # so |x / scale| <= 127 always holds and no value clips.
        scale = ((amax.mul_(1 / 127.0).view(torch.int32) + 0xFFFF) & ~0xFFFF).view(torch.float32)
        inverse = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
        q = torch.mul(blocks, inverse.unsqueeze(1)).round_().to(torch.int8)
        return torch.cat([q.view(-1).view(torch.uint8), scale.to(torch.bfloat16).view(torch.uint8)])

    def decode(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        q = buf[:n].view(torch.int8).view(-1, BLOCK)
        scale = buf[n:].view(torch.bfloat16).float()
        return (q.float() * scale.unsqueeze(1)).view(-1)


def codec_for(name: str) -> Codec | SparseCodec:
    """The codec a name stands for: int8, bf16, none, or a sparse codec's full name (wire/sparse.py)."""
    if name.startswith("sparse:"):
        return SparseCodec.from_name(name)
    codecs = {"int8": Int8Codec, "bf16": BF16Codec, "none": Codec}
    if name not in codecs:
        raise ValueError(f"unknown compression {name[:100]!r}; choose one of {', '.join(codecs)} or sparse:...")
    return codecs[name]()
