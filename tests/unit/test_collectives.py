"""The compressed all-reduce on real Gloo groups of real processes."""

from __future__ import annotations

import datetime
import hashlib
import socket

import pytest
import torch

from elastic_mesh.wire.codecs import BLOCK, codec_for
from elastic_mesh.wire.sparse import SparseCodec
from tests.conftest import member_processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _member(rank, world, port, size, compression, special, queue, streams=1):
    import torch.distributed as dist

    from elastic_mesh.wire.collectives import (
        CollectiveError,
        all_reduce_mean,
        decode_wire,
    )

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=60))
    if streams > 1:  # one more group (one more TCP connection per peer pair) per stream
        pg = [pg] + [dist.ProcessGroupGloo(dist.PrefixStore(f"s{i}/", store), rank, world,
                                           datetime.timedelta(seconds=60)) for i in range(1, streams)]
    x = torch.randn(size, generator=torch.Generator().manual_seed(rank))
    if special == "nan" and rank == 1:
        x[3] = float("nan")
    if special == "outlier" and rank == 2:
        x *= 1000
    codec = codec_for(compression)
    if special in ("truncating", "understating") and rank == 1:
        codec = _LyingSparseCodec(codec.chunk, codec.k, codec.bits, codec.packing, special)
    try:
        if special == "liar" and rank == 1:
            return _lie(pg, x, codec, world, queue)
        result = all_reduce_mean(pg, x, codec, [True] * world, outlier_factor=10.0)
        digest = hashlib.sha256(result.mean.numpy().tobytes()).hexdigest()
        # What a peer that missed the step replays (the wire bytes) must decode to the same mean, bit for bit.
        if result.wire is not None and not torch.equal(
                decode_wire(result.wire, codec_for(compression), result.layout), result.mean):
            digest = f"rank {rank}: the replayed wire bytes differ from the mean"
        # As a numpy array (pickled by value): a tensor goes through the queue as a file descriptor that
        # the receiver cannot open once this process has exited.
        queue.put((rank, digest, result.mean.numpy(), result.refused, result.bytes_sent, None))
    except CollectiveError as e:
        queue.put((rank, None, None, {}, 0, (e.phase, e.blame)))
    except BaseException as e:  # anything else is a bug: report it now rather than as a queue timeout
        queue.put((rank, None, None, {}, 0, ("crashed", repr(e))))
        raise


class _LyingSparseCodec(SparseCodec):
    """A sparse member whose bytes are not what it declares: cut short, or a contribution twice the
    norm its header states."""

    def __init__(self, chunk, k, bits, packing, how):
        super().__init__(chunk, k, bits, packing)
        object.__setattr__(self, "how", how)

    def encode(self, x):
        encoded = super().encode(x)
        return encoded[:-5] if self.how == "truncating" else encoded

    def decode(self, buf, n):
        if self.how == "truncating":
            return torch.ones(n)
        return super().decode(buf, n) / 2


def _lie(pg, x, codec, world, queue):
    """A hostile member speaking the wire protocol by hand: an honest-looking header, then garbage."""
    from elastic_mesh.wire.codecs import BLOCK
    from elastic_mesh.wire.collectives import header_size

    header = torch.tensor([1.0, float(x.norm()), 1.0, float(x.numel()), 0.0, *[0.0] * world, *range(world), 0.0])
    assert header.numel() == header_size(world)
    pg.allgather([[torch.empty(header_size(world)) for _ in range(world)]], [header]).wait()
    chunk = -(-(-(-x.numel() // world)) // BLOCK) * BLOCK
    garbage = codec.encode(torch.randn(chunk) * 1e6)
    try:
        for tag in (1, 2):  # scatter, then gather: pairwise steps, as the honest members do
            for step in range(1, world):
                if tag == 1:  # each scatter transfer is announced by a 4-byte marker, which times it
                    pg.send([torch.zeros(1)], (1 + step) % world, tag + 100).wait()
                    pg.recv([torch.empty(1)], (1 - step) % world, tag + 100).wait()
                sent = pg.send([garbage], (1 + step) % world, tag)
                pg.recv([torch.empty_like(garbage)], (1 - step) % world, tag).wait()
                sent.wait()
    except RuntimeError:
        pass  # the honest members stopped talking to it
    queue.put((1, None, None, {}, 0, ("liar", [])))


def run_members(world, size, compression="int8", special="", streams=1):
    ctx = member_processes(__name__)
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_member, args=(r, world, port, size, compression, special, queue, streams))
             for r in range(world)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=120) for _ in procs), key=lambda r: r[0])
    results = [(r[0], r[1], torch.from_numpy(r[2]) if r[2] is not None else None, *r[3:]) for r in results]
    for p in procs:
        p.join(timeout=60)
    crashed = [r for r in results if r[5] and r[5][0] == "crashed"]
    assert not crashed, f"members crashed instead of raising CollectiveError: {crashed}"
    return results


def exact_mean(world, size, skip=()):
    xs = [torch.randn(size, generator=torch.Generator().manual_seed(r)) for r in range(world) if r not in skip]
    return sum(xs) / len(xs)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_int8_error_is_under_one_percent_and_flat_in_members(world):
    size = 300_007  # not a multiple of the block or of the members
    results = run_members(world, size)
    assert len({h for _, h, *_ in results}) == 1, "members ended with different results"
    mean = results[0][2]
    exact = exact_mean(world, size)
    error = ((mean - exact).norm() / exact.norm()).item()
    assert error <= 0.01, f"relative RMS error {error:.4f} at {world} members"
    # Each member sends and receives 2 × (N-1)/N of the int8 payload: flat in N, ~1/3.9 of fp32.
    chunk = -(-(-(-size // world)) // BLOCK) * BLOCK
    header, marker = 4 * (6 + 2 * world), 4
    assert results[0][4] == 2 * (world - 1) * codec_for("int8").encoded_size(chunk) + (world - 1) * (header + marker)


@pytest.mark.parametrize("size", [5_000, 300_007])
def test_several_streams_per_peer_pair_give_the_same_bits(size):
    """Stripes over 3 groups (3 TCP connections per pair) cut at block boundaries: every int8 block and
    scale is the one a single stream makes, so the mean is bit-identical, and so is what is replayed."""
    single, striped = run_members(3, size), run_members(3, size, streams=3)
    assert len({h for _, h, *_ in striped}) == 1 and striped[0][1] == single[0][1]
    assert striped[0][4] >= single[0][4]  # the same payload; stripes may each pad their last block


@pytest.mark.parametrize("size", [0, 1, 63, 65])
def test_awkward_sizes(size):
    results = run_members(3, size)
    assert len({h for _, h, *_ in results}) == 1
    assert results[0][2].shape == (size,)
    if size:
        assert torch.allclose(results[0][2], exact_mean(3, size), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("compression, tolerance", [("none", 1e-6), ("bf16", 1e-2)])
def test_other_wire_formats(compression, tolerance):
    results = run_members(3, 10_000, compression)
    assert len({h for _, h, *_ in results}) == 1
    exact = exact_mean(3, 10_000)
    assert ((results[0][2] - exact).norm() / exact.norm()).item() <= tolerance


def test_non_finite_member_is_refused_by_everyone():
    results = run_members(3, 5_000, special="nan")
    assert all(r[3] == {1: "non-finite values"} for r in results)
    exact = exact_mean(3, 5_000, skip=(1,))
    assert ((results[0][2] - exact).norm() / exact.norm()).item() <= 0.01
    assert len({h for _, h, *_ in results}) == 1


def test_outlier_norm_is_refused():
    results = run_members(4, 5_000, special="outlier")
    assert 2 in results[0][3] and "median" in results[0][3][2]
    assert len({h for _, h, *_ in results}) == 1


def test_peer_lying_in_its_header_is_named():
    results = run_members(3, 5_000, special="liar")
    honest = [results[0][5], results[2][5]]
    assert all(e is not None for e in honest), "garbage from a lying peer went through"
    assert [1] in [blame for _, blame in honest], honest


def test_int8_codec_roundtrip_extremes():
    codec = codec_for("int8")
    for scale in (1e-30, 1e-3, 1.0, 1e30):
        x = torch.randn(4 * BLOCK, dtype=torch.float64).float() * scale
        y = codec.decode(codec.encode(x), x.numel())
        assert torch.isfinite(y).all()
        assert ((y.double() - x.double()).norm() / x.double().norm()).item() < 0.01
    zeros = torch.zeros(BLOCK)
    assert torch.equal(codec.decode(codec.encode(zeros), BLOCK), zeros)


def _ring_member(rank, world, port, size, queue):
    """A member whose link estimates say the route between members 0 and 1 is slow (as a previous
    all-reduce would have measured): the ring must avoid it, and the mean must not change."""
    import torch.distributed as dist

    from elastic_mesh.wire.collectives import all_reduce_mean
    from elastic_mesh.wire.topology import LinkEstimates

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=60))
    x = torch.randn(size, generator=torch.Generator().manual_seed(rank))
    names = [f"node{r}" for r in range(world)]
    links = LinkEstimates()
    for peer in range(world):  # seeded: loopback has no slow route to measure
        if peer != rank:
            links.observe(names[peer], 1_000_000, 10.0 if {rank, peer} == {0, 1} else 1.0)
    plain = all_reduce_mean(pg, x, codec_for("int8"), [True] * world)
    ordered = all_reduce_mean(pg, x, codec_for("int8"), [True] * world, links=links, peers=names)
    queue.put((rank, plain.ring, ordered.ring, ordered.ring_changed, torch.equal(plain.mean, ordered.mean),
               hashlib.sha256(ordered.mean.numpy().tobytes()).hexdigest()))


def test_measured_ring_avoids_a_slow_route_and_gives_the_same_bits():
    world, size = 4, 50_000
    ctx = member_processes(__name__)
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_ring_member, args=(r, world, port, size, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=120) for _ in procs), key=lambda r: r[0])
    for p in procs:
        p.join(timeout=60)
    rings = {tuple(r[2]) for r in results}
    assert len(rings) == 1, f"members chose different rings: {rings}"
    ring = list(rings.pop())
    assert results[0][1] == [0, 1, 2, 3]  # without estimates: rank order
    hops = {(ring[k], ring[(k + 1) % world]) for k in range(world)}
    assert not hops & {(0, 1), (1, 0)}, f"ring {ring} still crosses the slow route"
    assert all(r[3] for r in results), "the ring change was not reported"
    assert all(r[4] for r in results), "the mean changed with the ring"
    assert len({r[5] for r in results}) == 1


def _paced_member(rank, world, port, size, spread_s, queue):
    """Member 0 asks for no pacing, the others for spread_s: all pace alike (the longest spread wins)."""
    import time

    import torch.distributed as dist

    from elastic_mesh.wire.collectives import all_reduce_mean

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=60))
    x = torch.randn(size, generator=torch.Generator().manual_seed(rank))
    plain = all_reduce_mean(pg, x, codec_for("int8"), [True] * world)
    started = time.perf_counter()
    paced = all_reduce_mean(pg, x, codec_for("int8"), [True] * world, spread_s=spread_s if rank else None)
    queue.put((rank, plain.seconds, time.perf_counter() - started, torch.equal(plain.mean, paced.mean),
               hashlib.sha256(paced.mean.numpy().tobytes()).hexdigest(), paced.bytes_sent == plain.bytes_sent))


def test_paced_all_reduce_spreads_its_sends_and_gives_the_same_bits():
    """Loopback moves these bytes in milliseconds; paced, the same all-reduce takes about spread_s, and
    a member that asked for no pacing paces and cuts its transfers like the others."""
    world, size, spread_s = 3, 600_000, 2.0
    ctx = member_processes(__name__)
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_paced_member, args=(r, world, port, size, spread_s, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=120) for _ in procs), key=lambda r: r[0])
    for p in procs:
        p.join(timeout=60)
    assert all(r[3] and r[5] for r in results), "pacing changed the mean or the bytes"
    assert len({r[4] for r in results}) == 1
    plain_s, paced_s = max(r[1] for r in results), min(r[2] for r in results)
    assert paced_s >= 0.75 * spread_s, f"paced all-reduce took {paced_s:.2f} s, not spread over {spread_s} s"
    assert paced_s <= 2.5 * spread_s and plain_s < 0.5 * spread_s, (plain_s, paced_s)


def test_members_agree_on_the_longest_spread_and_ignore_absurd_ones():
    from elastic_mesh.wire.collectives import _agree_on_spread, header_size
    from elastic_mesh.wire.pacing import MIN_PIECE, piece_bytes

    def header(spread):
        return torch.tensor([1, 1, 1, 100, 0, 0, 0, 0, 1, spread], dtype=torch.float32)

    assert header(0).numel() == header_size(2)
    assert _agree_on_spread([header(0), header(0)]) == 0
    assert _agree_on_spread([header(2.0), header(0), header(8.0)]) == 8.0
    for hostile in (1e-9, float("nan"), float("inf"), 1e12, -5):
        assert _agree_on_spread([header(hostile), header(3.0)]) == 3.0
    assert piece_bytes(1.0) == MIN_PIECE  # however slow the agreed pace, pieces stay whole-packet sized
