"""The sparse wire format (elastic_mesh/wire/sparse.py) and its exchange on real Gloo groups of real
processes (wire/sparse_gather.py): sizes, determinism, what hostile bytes get, and the mean every
member ends with."""

from __future__ import annotations

import struct

import pytest
import torch

from elastic_mesh.wire.collectives import decode_wire
from elastic_mesh.wire.sparse import SparseCodec, pack_bits, unpack_bits
from tests.unit.test_collectives import exact_mean, run_members

ANCHOR = "sparse:chunk=4096,k=64,bits=2,packing=fixed"
RICE = "sparse:chunk=4096,k=64,bits=2,packing=rice"


def _topk_dense(x: torch.Tensor, chunk: int, k: int) -> torch.Tensor:
    """x with everything but the k largest magnitudes of each chunk set to zero (what the codec keeps)."""
    n = x.numel()
    padded = torch.zeros(-(-n // chunk) * chunk)
    padded[:n] = x
    table = padded.view(-1, chunk)
    index = table.abs().topk(k, dim=1).indices
    out = torch.zeros_like(table).scatter_(1, index, table.gather(1, index))
    return out.view(-1)[:n]


def test_bit_packing_roundtrips_any_width():
    values = torch.randint(0, 1 << 12, (1001,))
    for width in (1, 2, 5, 12, 13):
        v = values & ((1 << width) - 1)
        assert torch.equal(unpack_bits(pack_bits(v, width), v.numel(), width), v)
    # Two 12-bit indices in three bytes: the anchor's packing.
    assert len(pack_bits(torch.tensor([0xABC, 0x123]), 12)) == 3


@pytest.mark.parametrize("packing", ["fixed", "rice"])
def test_keeps_the_top_k_of_every_chunk_with_signs_and_levels(packing):
    codec = SparseCodec(4096, 64, 2, packing)
    x = torch.randn(3 * 4096 + 1000, generator=torch.Generator().manual_seed(0))
    y = codec.decode(codec.encode(x), x.numel())
    kept = _topk_dense(x, 4096, 64)
    assert torch.equal(y != 0, kept != 0), "the kept positions are not the top-k of each chunk"
    assert torch.equal(torch.sign(y), torch.sign(kept))
    # 2 bits: each chunk's values take 2 magnitudes; the error on the kept values is the quantizer's.
    assert all(len(set(c[c != 0].abs().tolist())) <= 2 for c in y.split(4096))
    error = ((y - kept).norm() / kept.norm()).item()
    assert error < 0.12, error
    assert torch.equal(y, codec.decode(codec.encode(x), x.numel())), "decoding is not deterministic"


def test_sizes_beat_the_anchor_and_stay_under_the_bound():
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(1))
    anchor, rice = SparseCodec.from_name(ANCHOR), SparseCodec.from_name(RICE)
    fixed_bytes, rice_bytes = anchor.encode(x).numel(), rice.encode(x).numel()
    chunks = (1 << 20) // 4096
    # Fixed: 2 + 12 bits a kept value, two bf16 levels a chunk, a 32-byte header.
    assert fixed_bytes == 32 + chunks * (4 + 16 + 96)
    assert rice_bytes < 0.75 * fixed_bytes, (rice_bytes, fixed_bytes)
    assert fixed_bytes <= anchor.max_size(x.numel()) and rice_bytes <= rice.max_size(x.numel())
    # The worst case for Rice: a chunk whose kept values sit at its two ends.
    clustered = torch.zeros(1 << 20)
    clustered.view(-1, 4096)[:, :32] = 1.0
    clustered.view(-1, 4096)[:, -32:] = -1.0
    assert rice.encode(clustered).numel() <= rice.max_size(clustered.numel())
    assert 4 * x.numel() / rice_bytes > 190  # fp32 over sparse, per round: the benchmark's basis


@pytest.mark.parametrize("n", [1, 63, 4096, 4097])
def test_awkward_sizes_and_zeros(n):
    codec = SparseCodec(64, 8, 2, "rice")
    x = torch.randn(n)
    assert codec.decode(codec.encode(x), n).shape == (n,)
    assert torch.equal(codec.decode(codec.encode(torch.zeros(n)), n), torch.zeros(n))


def test_hostile_bytes_get_a_value_error_not_a_crash():
    codec = SparseCodec.from_name(RICE)
    n = 3 * 4096
    good = codec.encode(torch.randn(n)).numpy().tobytes()
    cases = {
        "empty": b"",
        "short": good[:-1],
        "long": good + b"\0",
        "magic": b"JUNK" + good[4:],
        "other n": good[:4] + struct.pack("<q", n + 1) + good[12:],
        "other k": good[:16] + struct.pack("<i", 32) + good[20:],
        "rice r": good[:26] + bytes([200]) + good[27:],
        "unary count": good[:28] + struct.pack("<q", 10 ** 12),
        "nan level": good[:32] + b"\xc0\x7f" + good[34:],
        "too few symbols": good[:-8] + b"\xff" * 8,
    }
    for name, data in cases.items():
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
        with pytest.raises(ValueError):
            codec.decode(buf, n)
    fixed = SparseCodec.from_name(ANCHOR)
    data = bytearray(fixed.encode(torch.randn(n)).numpy().tobytes())
    data[-1] ^= 0xF0  # the last index of the last chunk now falls below its neighbour
    with pytest.raises(ValueError, match="increasing|outside"):
        fixed.decode(torch.frombuffer(data, dtype=torch.uint8), n)


def test_values_near_the_float32_limit_do_not_decode_to_infinities():
    """Their bf16 level rounds to infinity: decoding refuses it (the exchange then treats the
    contribution as non-finite, which everyone leaves out)."""
    codec = SparseCodec(64, 8, 2, "rice")
    with pytest.raises(ValueError, match="not finite"):
        codec.decode(codec.encode(torch.full((64,), 3.3e38)), 64)


def test_settings_are_validated_and_named():
    for bad in [dict(k=0), dict(k=5000), dict(bits=0), dict(bits=5), dict(k=63, bits=2), dict(packing="zip"),
                dict(chunk=1)]:
        with pytest.raises(ValueError):
            SparseCodec(**{**dict(chunk=4096, k=64, bits=2, packing="rice"), **bad})
    assert SparseCodec.from_name(RICE) == SparseCodec()
    with pytest.raises(ValueError):
        SparseCodec.from_name("sparse:chunk=4096,k=64")


@pytest.mark.parametrize("world, compression", [(2, RICE), (4, RICE), (3, ANCHOR)])
def test_exchange_gives_every_member_the_mean_of_the_decoded_contributions(world, compression):
    size = 50_003
    results = run_members(world, size, compression)
    assert all(r[5] is None for r in results), results
    assert len({h for _, h, *_ in results}) == 1, "members ended with different results"
    codec = SparseCodec.from_name(compression)
    xs = [torch.randn(size, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    expected = sum(codec.decode(codec.encode(x), size) for x in xs) / world
    assert torch.allclose(results[0][2], expected, rtol=1e-6, atol=1e-7)
    # Each member sends its own contribution to every other member, and no more than that.
    assert results[0][4] <= (world - 1) * (codec.max_size(size) + 4 * (6 + 2 * world) + 12)
    # The sparse mean points the way of the exact one.
    exact = exact_mean(world, size)
    cosine = float(results[0][2] @ exact / (results[0][2].norm() * exact.norm()))
    assert cosine > 0.1


def test_non_finite_and_outlier_contributions_are_left_out_by_everyone():
    results = run_members(3, 20_000, RICE, special="nan")
    assert all(r[3] == {1: "non-finite values"} for r in results)
    assert len({h for _, h, *_ in results}) == 1
    results = run_members(4, 20_000, RICE, special="outlier")
    assert all(2 in r[3] and "median" in r[3][2] for r in results)
    assert len({h for _, h, *_ in results}) == 1


@pytest.mark.parametrize("special", ["truncating", "understating"])
def test_a_member_whose_bytes_do_not_match_its_header_is_named(special):
    results = run_members(3, 20_000, RICE, special=special)
    honest = [results[0][5], results[2][5]]
    assert all(e is not None for e in honest), "a contribution that is not what was declared went through"
    # The first to decode it names it; the other may only see that member stop talking (the vote adds them).
    assert [1] in [blame for _, blame in honest], honest


def test_replayed_wire_decodes_to_the_mean_and_refuses_a_bad_layout():
    codec = SparseCodec(256, 16, 2, "rice")
    parts = [codec.encode(torch.randn(1000)) for _ in range(3)]
    wire = torch.cat(parts)
    layout = [[1000, *(p.numel() for p in parts)]]
    mean = decode_wire(wire, codec.name, layout)
    assert torch.equal(mean, sum(codec.decode(p, 1000) for p in parts) / 3)
    with pytest.raises(ValueError):
        decode_wire(wire, codec.name, [[1000, parts[0].numel(), parts[1].numel()]])
    with pytest.raises(ValueError):
        decode_wire(wire[:-1], codec.name, layout)
