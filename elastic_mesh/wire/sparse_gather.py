"""The mean of sparse contributions (wire/sparse.py) over a Gloo group: gathered whole, not summed hop by hop.

Sparse contributions cannot be summed on the way like the int8 scatter does: the sum of M top-k
selections holds up to M·k values a chunk, and re-selecting it would lose what one member kept. So
every member sends its encoded contribution to every other (pairwise steps along the ring, the int8
path's order, pacing and link timing), and every member decodes all of them and sums them in rank
order, then divides: the same bytes and the same operations give bit-identical means everywhere.

The agreement before the data is the int8 path's header (collectives.agree), with the norm of the
contribution as it decodes, so the outlier screen judges what would be averaged. Then the lengths:
a length over what the codec can produce for the tensor, bytes that do not decode, or a decoded norm
other than the declared one name the sender. A member left out (not contributing, refused) sends one
byte in place of its contribution.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.distributed as dist

from elastic_mesh.wire.collectives import AllReduceResult, agree, header_size
from elastic_mesh.wire.pacing import Pacer, piece_bytes
from elastic_mesh.wire.sparse import SparseCodec
from elastic_mesh.wire.steps import CollectiveError, pairwise, post, slow_peers, wait
from elastic_mesh.wire.topology import LinkEstimates

PLACEHOLDER = torch.zeros(1, dtype=torch.uint8)  # what a member that is left out sends
NORM_SLACK = 1e-4  # decoding is exact; the norm's summation order may differ between CPUs


def gather_mean(pg: dist.ProcessGroup, x: torch.Tensor, codec: SparseCodec, contributes: list[bool], valid: bool,
                outlier_factor: float, on_phase: Callable[[str], None] | None, links: LinkEstimates | None,
                peers: list[str], spread_s: float | None, finish_s: float | None, started: float) -> AllReduceResult:
    """collectives.all_reduce_mean for a sparse codec (same arguments, same result). The result's `sent`
    is this member's contribution as everyone decoded it (for its error feedback), None if it was left out."""
    rank, world, n = pg.rank(), pg.size(), x.numel()
    offering = contributes[rank] and valid and bool(torch.isfinite(x).all()) and n > 0
    encoded, own = PLACEHOLDER, x
    if offering:
        encoded = codec.encode(x)
        try:
            own = codec.decode(encoded, n)
        except ValueError:  # values near the float32 limit round to an infinite bf16 level: not finite either
            offering, encoded, own = False, PLACEHOLDER, torch.full_like(x, float("nan"))
    agreed = agree(pg, own, (world - 1) * encoded.numel(), contributes, valid, outlier_factor, links, peers, spread_s)
    if not agreed.contributors or n == 0:
        return AllReduceResult(torch.zeros_like(x), agreed.contributors, agreed.refused,
                               seconds=time.perf_counter() - started)
    outgoing = encoded if rank in agreed.contributors else PLACEHOLDER
    lengths = _lengths(pg, outgoing.numel())
    limit = codec.max_size(n)
    for r in range(world):
        expected_max = limit if r in agreed.contributors else 1
        if not 1 <= lengths[r] <= expected_max:
            raise CollectiveError(f"rank {r} announced a {lengths[r]}-byte contribution (at most {expected_max})",
                                  "header", blame=[r])
    if on_phase:  # the data is about to move: a fault injected here strikes mid-exchange
        on_phase("scatter")
    received = {r: torch.empty(lengths[r], dtype=torch.uint8) for r in range(world) if r != rank}
    decoded: dict[int, torch.Tensor] = {}

    def arrived(r: int) -> None:
        if r not in agreed.contributors:
            return
        if r == rank:
            decoded[r] = own
            return
        try:
            part = codec.decode(received[r], n)
        except ValueError as e:
            raise CollectiveError(f"rank {r} sent bytes that are not a contribution: {e}", "gather", blame=[r]) from e
        declared, norm = float(agreed.headers[r][1]), float(part.norm())
        if not math.isclose(norm, declared, rel_tol=NORM_SLACK, abs_tol=1e-12):
            raise CollectiveError(f"rank {r} sent a contribution of norm {norm:.6g}, not the {declared:.6g} its "
                                  "header declared", "gather", blame=[r])
        decoded[r] = part

    timed = (lambda frm, nbytes, seconds: links.observe(peers[frm], nbytes, seconds)) if links else None
    piece = piece_bytes(agreed.pace) if agreed.pace else 0
    pacer = Pacer(agreed.pace, agreed.to_send, end_s=finish_s) if agreed.pace else None
    pairwise(pg, lambda to: outgoing, received.__getitem__, "gather", 3, arrived, agreed.ring, timed,
             slow_peers(rank, agreed.rates), piece, pacer)
    if on_phase:
        on_phase("gather")
    mean = _mean([decoded[r] for r in agreed.contributors])
    wire_parts = [encoded if r == rank else received[r] for r in agreed.contributors]
    moved = (world - 1) * (outgoing.numel() + 4 * header_size(world) + 4 + 8)  # data, header, marker, length
    return AllReduceResult(mean, agreed.contributors, agreed.refused, moved,
                           sum(lengths[r] for r in range(world) if r != rank), time.perf_counter() - started,
                           wire=torch.cat(wire_parts), layout=[[n, *(p.numel() for p in wire_parts)]],
                           ring=agreed.ring, ring_changed=agreed.ring_changed, rates=agreed.rates,
                           sent=own if rank in agreed.contributors else None)


def _lengths(pg: dist.ProcessGroup, mine: int) -> list[int]:
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(pg.size())]
    wait(post(lambda: pg.allgather([out], [torch.tensor([mine], dtype=torch.int64)]), "header"), "header")
    return [int(t) for t in out]


def _mean(parts: list[torch.Tensor]) -> torch.Tensor:
    """Summed in the order given (rank order), then divided: the one computation every member does."""
    total = torch.zeros_like(parts[0])
    for part in parts:
        total += part
    return total / len(parts)


def sparse_mean(wire: torch.Tensor, codec: SparseCodec, layout: list[list[int]]) -> torch.Tensor:
    """The mean a sparse exchange produced, from its `wire` (the contributors' encodings in rank order)
    and `layout` ([[elements, length of each]]): what a member that missed the step replays."""
    if len(layout) != 1 or len(layout[0]) < 2:
        raise ValueError("a sparse exchange's layout is [[elements, length of each contribution, ...]]")
    n, lengths = layout[0][0], layout[0][1:]
    if any(length < 1 for length in lengths) or sum(lengths) != wire.numel():
        raise ValueError(f"contribution lengths {sum(lengths)} do not add up to the {wire.numel()} bytes")
    parts, offset = [], 0
    for length in lengths:
        parts.append(codec.decode(wire[offset:offset + length], n))
        offset += length
    return _mean(parts)
