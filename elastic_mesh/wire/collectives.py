"""All-reduce (mean) of one flat fp32 tensor over a Gloo group, compressed on the wire.

Two phases, so quantization error does not grow with the number of members (a ring that re-quantizes
partial sums at every hop would):

1. scatter: every member cuts its tensor into one chunk per member, encodes each chunk once and
   sends chunk j to member j (pairwise exchange steps). Member j decodes the contributions and sums them in fp32,
   in rank order, then divides by the number of contributors.
2. gather: member j encodes its mean chunk once and sends it to every other member (pairwise steps). Every member, j included, decodes
   the same bytes, so all members end with bit-identical results.

With several groups (one TCP connection per peer pair each: mesh.streams_per_peer), the tensor is
cut into one stripe per group and the stripes move at once: a single TCP stream on a long, lossy path
is capped by loss recovery (≈ MSS / RTT × 1.22 / √loss) well below the link rate.

Before the data moves, members exchange a small header (finite? norm?), so a member whose tensor is
non-finite or absurdly large is left out of the mean by everyone alike and named. Received scales are
checked too: a peer that lies in its header and sends garbage is named in the error.

The header also carries the link rates each member measured coming in during the last scatter; with
them every member picks the same ring for both phases (elastic_mesh/wire/topology.py), one whose slowest
hop is fast. The order changes who talks to whom when, never what is summed: results are bit-identical
whatever the ring.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from elastic_mesh.wire.codecs import BLOCK, Codec, codec_for
from elastic_mesh.wire.pacing import MAX_SPREAD_S, MIN_SPREAD_S, Pacer, piece_bytes
from elastic_mesh.wire.socket_pacing import GroupSockets
from elastic_mesh.wire.sparse import SparseCodec
from elastic_mesh.wire.steps import CollectiveError, pairwise, post, ring_gather, slow_peers, wait
from elastic_mesh.wire.topology import LinkEstimates, choose_ring, rate_matrix


@dataclass
class AllReduceResult:
    mean: torch.Tensor
    contributors: list[int]
    refused: dict[int, str] = field(default_factory=dict)  # rank -> why its tensor was left out
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    # The encoded mean exactly as every member decoded it: per stripe (`layout`: [chunk, elements, members]),
    # chunk of owner r at r × its encoded size. A peer that missed the step replays it from these bytes,
    # bit-identically and compressed.
    wire: torch.Tensor | None = None
    layout: list[list[int]] = field(default_factory=list)
    ring: list[int] = field(default_factory=list)  # the order both phases took (ranks)
    ring_changed: bool = False
    rates: list[list[float]] | None = None  # bytes/s from i to j the ring was chosen on (None: no measurements)
    kernel_paced: int = 0  # connections the kernel paced as well as the token bucket (socket_pacing.py)
    # A sparse exchange: this member's contribution as every member decoded it (None: it was left out),
    # which its error feedback takes away from what it owes.
    sent: torch.Tensor | None = None


def decode_wire(wire: torch.Tensor, codec: Codec | SparseCodec | str, layout: list[list[int]]) -> torch.Tensor:
    """The mean an all-reduce produced, from its `wire` bytes (what each member computed, bit for bit).
    codec: the one it was encoded with, or its name. Raises ValueError for bytes that do not fit."""
    codec = codec_for(codec) if isinstance(codec, str) else codec
    if isinstance(codec, SparseCodec):
        from elastic_mesh.wire.sparse_gather import sparse_mean
        return sparse_mean(wire, codec, layout)
    out, offset = [], 0
    for chunk, elements, world in layout:
        encoded = codec.encoded_size(chunk)
        pieces = [codec.decode(wire[offset + r * encoded:offset + (r + 1) * encoded], chunk) for r in range(world)]
        out.append(torch.cat(pieces)[:elements])
        offset += encoded * world
    return torch.cat(out) if out else torch.zeros(0)


def all_reduce_mean(pg: dist.ProcessGroup | list[dist.ProcessGroup], x: torch.Tensor, codec: Codec,
                    contributes: list[bool], valid: bool = True, outlier_factor: float = math.inf,
                    on_phase: Callable[[str], None] | None = None, links: LinkEstimates | None = None,
                    peers: list[str] | None = None, spread_s: float | None = None,
                    finish_s: float | None = None,
                    sockets: list[GroupSockets | None] | None = None) -> AllReduceResult:
    """Mean of `x` over the members whose `contributes` is true and whose tensor passes the header check.

    pg: one group, or several over the same members (one stripe of the tensor moves over each, at once).
    valid=False lets a caller that checked more than this tensor (e.g. all shards of a node) refuse it;
    a norm above outlier_factor × the median of the others' (3+ contributors) is refused as absurd.
    links: this member's measured link rates (updated here), keyed by `peers` (a name per rank); the
    ring follows the measurements only if every member passes links, else it is rank order.
    spread_s: pace the sends so that they take about this long in all (elastic_mesh/wire/pacing.py) rather
    than going at the link's rate; a slower link still takes as long as it takes. Members agree on the
    longest spread any of them asks for: the all-reduce ends with its slowest sender anyway.
    finish_s: this member's own limit, if later than the spread (slack before anyone waits for the
    result): a sender behind the spread's schedule speeds up only as much as it must to end by it.
    sockets: each group's TCP connections, where known (socket_pacing.py): a paced all-reduce has the
    kernel pace them too, so the bytes leave evenly within each piece and after a stall.
    """
    started = time.perf_counter()
    groups = list(pg) if isinstance(pg, (list, tuple)) else [pg]
    x = x.detach().reshape(-1).float().cpu()
    peers = peers or [str(r) for r in range(groups[0].size())]
    if isinstance(codec, SparseCodec):  # contributions are gathered whole, not summed hop by hop
        from elastic_mesh.wire.sparse_gather import gather_mean
        return gather_mean(groups[0], x, codec, contributes, valid, outlier_factor, on_phase, links, peers,
                           spread_s, finish_s, started)
    world = groups[0].size()
    # What each member sends (both phases), paced to the agreed spread, in pieces everyone cuts alike.
    to_send = 2 * (world - 1) * codec.encoded_size(-(-x.numel() // world))
    agreed = agree(groups[0], x, to_send, contributes, valid, outlier_factor, links, peers, spread_s)
    if not agreed.contributors or x.numel() == 0:
        return AllReduceResult(torch.zeros_like(x), agreed.contributors, agreed.refused,
                               seconds=time.perf_counter() - started)
    runner = _StripeRunner(groups, x, codec, agreed, on_phase, links, peers, finish_s, sockets)
    stripes = runner.run()
    # Both phases, the headers and the 4-byte markers that time each scatter transfer.
    moved = sum(st.moved for st in stripes) + (world - 1) * (4 * header_size(world) + 4 * len(stripes))
    return AllReduceResult(torch.cat([st.mean for st in stripes]), agreed.contributors, agreed.refused, moved, moved,
                           time.perf_counter() - started, wire=torch.cat([st.wire for st in stripes]),
                           layout=[[st.chunk, st.mean.numel(), world] for st in stripes], ring=agreed.ring,
                           ring_changed=agreed.ring_changed, rates=agreed.rates, kernel_paced=runner.kernel_paced)


@dataclass
class Agreement:
    """What every member decided alike from everyone's header: who contributes (and who is refused,
    why), the ring both phases take, the rates it was chosen on, and the pace of the sends."""

    headers: list[torch.Tensor]
    contributors: list[int]
    refused: dict[int, str]
    ring: list[int]
    rates: list[list[float]] | None
    ring_changed: bool
    to_send: int  # bytes this member sends in both phases
    pace: float | None  # bytes/s its sends are posted at (None: the link's rate)


def agree(pg: dist.ProcessGroup, x: torch.Tensor, to_send: int, contributes: list[bool], valid: bool,
          outlier_factor: float, links: LinkEstimates | None, peers: list[str],
          spread_s: float | None) -> Agreement:
    """The agreement step: every member sends its header (finite? norm? contributes? size, measured
    link rates, last ring, spread) and decides the same from everyone's. to_send: the bytes this member
    will send, which the agreed spread paces."""
    rank, world = pg.rank(), pg.size()
    norm = float(x.norm()) if x.numel() else 0.0
    finite = valid and math.isfinite(norm)
    header = torch.tensor([1.0 if finite else 0.0, norm if finite else 0.0, 1.0 if contributes[rank] else 0.0,
                           float(x.numel()), 1.0 if links else 0.0,
                           *(links.incoming(peers) if links else [0.0] * world),
                           *(links.last_ring(peers) if links else range(world)), spread_s or 0.0])
    headers = [torch.empty(header_size(world)) for _ in range(world)]
    wait(post(lambda: pg.allgather([headers], [header]), "header"), "header")
    sizes = {int(h[3]) for h in headers}
    if len(sizes) != 1:
        raise CollectiveError(f"members disagree on the tensor size: {sorted(sizes)}", "header")
    ring, rates = _agree_on_ring(headers, world)
    spread = _agree_on_spread(headers)
    ring_changed = False
    if links:
        ring_changed = links.last_ring(peers) != ring
        links.used(ring, peers)
    refused: dict[int, str] = {}
    for r, h in enumerate(headers):
        if contributes[r] and h[0] == 0:
            refused[r] = "non-finite values"
    norms = {r: float(h[1]) for r, h in enumerate(headers) if contributes[r] and r not in refused}
    for r, n in norms.items():
        others = sorted(v for q, v in norms.items() if q != r)
        if len(others) >= 2 and n > outlier_factor * max(others[len(others) // 2], 1e-30):
            refused[r] = f"norm {n:.3g} is over {outlier_factor:g}× the others' median {others[len(others) // 2]:.3g}"
    contributors = [r for r in range(world) if contributes[r] and r not in refused]
    pace = to_send / spread if spread and world > 1 and to_send else None
    return Agreement(headers, contributors, refused, ring, rates, ring_changed, to_send, pace)


class _StripeRunner:
    """The transfer after the agreement: the tensor cut into one stripe per group (whole int8 blocks), each
    stripe's scatter and gather on its own thread, on_phase("scatter") once every scatter is done; the
    sends of all stripes paced together. A failure of one stripe fails the whole all-reduce, the peer at
    fault named where known."""

    def __init__(self, groups: list[dist.ProcessGroup], x: torch.Tensor, codec: Codec, agreed: Agreement,
                 on_phase: Callable[[str], None] | None, links: LinkEstimates | None, peers: list[str],
                 finish_s: float | None, sockets: list[GroupSockets | None] | None) -> None:
        self.groups, self.x, self.codec, self.agreed, self.on_phase = groups, x, codec, agreed, on_phase
        total = x.numel()
        # Stripes of whole blocks (the int8 scales cover BLOCK elements), as even as that allows.
        per_stripe = -(-(-(-total // len(groups))) // BLOCK) * BLOCK
        self.bounds = [(start, min(total, start + per_stripe)) for start in range(0, total, per_stripe)]
        self.slow = slow_peers(groups[0].rank(), agreed.rates)
        # Only stripe 0 is timed: with S stripes each sees about 1/S of a route, enough to tell the slow ones.
        self.timed = (lambda frm, nbytes, seconds: links.observe(peers[frm], nbytes, seconds)) if links else None
        self.piece = piece_bytes(agreed.pace) if agreed.pace else 0
        # The bucket paces each member's sends in all; each connection gets its stripe's share as a cap.
        self.capped = [s for s in (sockets or [])[:len(self.bounds)] if s is not None] if agreed.pace else []
        self.pacer = Pacer(agreed.pace, agreed.to_send, on_rate=self._cap, end_s=finish_s) if agreed.pace else None
        self.kernel_paced = 0
        self.errors: list[CollectiveError] = []
        self._phases_done = threading.Barrier(len(self.bounds))

    def _cap(self, rate: float | None) -> int:
        return sum(s.pace(None if rate is None else rate / len(self.bounds)) for s in self.capped)

    def run(self) -> list[_Stripe]:
        stripes: list[_Stripe | None] = [None] * len(self.bounds)
        try:
            self.kernel_paced = self._cap(self.agreed.pace) if self.capped else 0
            threads = [threading.Thread(target=self._stripe, args=(i, stripes), daemon=True,
                                        name=f"all-reduce-stripe-{i}") for i in range(1, len(self.bounds))]
            for t in threads:
                t.start()
            self._stripe(0, stripes)
            for t in threads:
                t.join()
        finally:
            if self.capped:  # the group's next, unpaced all-reduce goes at the link's rate
                self._cap(None)
        if self.errors:
            blamed = [e for e in self.errors if e.blame]
            raise (blamed or self.errors)[0]
        if self.on_phase:
            self.on_phase("gather")
        return stripes

    def _stripe(self, i: int, out: list) -> None:
        def after_scatter() -> None:
            try:
                self._phases_done.wait()  # on_phase("scatter") comes once every stripe's scatter is done
            except threading.BrokenBarrierError:  # another stripe failed; its error is the one raised
                return
            if i == 0 and self.on_phase:
                self.on_phase("scatter")
        try:
            start, end = self.bounds[i]
            out[i] = _reduce_stripe(self.groups[i], self.x[start:end], self.codec, self.agreed.contributors,
                                    self.agreed.headers, after_scatter, self.agreed.ring,
                                    self.timed if i == 0 else None, self.slow, self.piece, self.pacer)
        except CollectiveError as e:
            self.errors.append(e)
            self._phases_done.abort()
        except Exception as e:  # any other failure of one stripe fails the whole all-reduce, named
            self.errors.append(CollectiveError(f"stripe {i}: {type(e).__name__}: {e}", "scatter"))
            self._phases_done.abort()


def header_size(world: int) -> int:
    """Floats in a member's header: finite, norm, contributes, elements, follows-links, then its
    measured incoming rate from each member, then the ring it last used (only member 0's counts), then
    the seconds it would spread its sends over (0: it does not pace)."""
    return 6 + 2 * world


def _agree_on_ring(headers: list[torch.Tensor], world: int) -> tuple[list[int], list[list[float]] | None]:
    """The ring every member computes alike from the same headers: rank order unless every member
    follows links; else member 0's last ring, or a ring with a clearly faster slowest hop."""
    identity = list(range(world))
    if world <= 2 or not all(h[4] == 1 for h in headers):
        return identity, None
    previous = [int(v) if math.isfinite(v) else -1 for v in headers[0][5 + world:5 + 2 * world].tolist()]
    if sorted(previous) != identity:  # member 0 sent nonsense: start over from rank order
        previous = identity
    rates = rate_matrix([h[5:5 + world].tolist() for h in headers])
    if rates is None:
        return previous, None
    return choose_ring(rates, previous), rates


def _agree_on_spread(headers: list[torch.Tensor]) -> float:
    """Seconds every member spreads its sends over: the longest any member asks for (0: no pacing).
    A value outside [MIN_SPREAD_S, MAX_SPREAD_S] (NaN included) is ignored, so a hostile header can
    neither make pieces tiny (millions of sends) nor stretch a round past what any node would ask."""
    return max([float(h[-1]) for h in headers if MIN_SPREAD_S <= h[-1] <= MAX_SPREAD_S] or [0.0])


@dataclass
class _Stripe:
    mean: torch.Tensor
    wire: torch.Tensor
    chunk: int
    moved: int


def _reduce_stripe(pg: dist.ProcessGroup, x: torch.Tensor, codec: Codec, contributors: list[int],
                   headers: list[torch.Tensor], after_scatter: Callable[[], None], ring: list[int],
                   timed: Callable[[int, int, float], None] | None, slow: set[int], piece: int,
                   pacer: Pacer | None) -> _Stripe:
    """Scatter then gather of one stripe over one group (see the module's docstring)."""
    rank, world = pg.rank(), pg.size()
    total = x.numel()
    chunk = -(-total // world)
    chunk = -(-chunk // BLOCK) * BLOCK
    padded = torch.zeros(chunk * world)
    if rank in contributors:
        padded[:total] = x
    encoded = codec.encoded_size(chunk)
    outgoing: dict[int, torch.Tensor] = {}

    def encoded_chunk(j: int) -> torch.Tensor:  # encoded when first needed, so encoding overlaps sending
        if j not in outgoing:
            outgoing[j] = codec.encode(padded[j * chunk:(j + 1) * chunk])
        return outgoing[j]

    recv = torch.empty(encoded * world, dtype=torch.uint8)
    # A chunk cannot be larger than the whole tensor its sender declared; int8 carries no NaN, so this
    # (with finite scales) is what catches a peer that lies in its header and sends garbage.
    slack = 1.05
    parts: dict[int, torch.Tensor] = {}

    def accumulate(r: int) -> None:
        if r not in contributors:
            return
        buf = encoded_chunk(r) if r == rank else recv[r * encoded:(r + 1) * encoded]
        part = codec.decode(buf, chunk)
        part_norm = float(part.norm())
        if not math.isfinite(part_norm) or part_norm > slack * float(headers[r][1]) + 1e-12:
            raise CollectiveError(f"rank {r} sent data for chunk {rank} that does not match its header "
                                  f"(norm {part_norm:.3g}, declared {float(headers[r][1]):.3g})", "scatter", blame=[r])
        parts[r] = part

    pairwise(pg, encoded_chunk, lambda peer: recv[peer * encoded:(peer + 1) * encoded], "scatter", 1, accumulate,
              ring, timed, slow, piece, pacer)
    after_scatter()
    mean_chunk = torch.zeros(chunk)
    for r in contributors:  # summed in rank order, whatever order they arrived in: deterministic
        mean_chunk += parts[r]
    mean_chunk /= len(contributors)

    mine = codec.encode(mean_chunk)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    gathered[rank] = mine
    mean = torch.empty(chunk * world)
    bound = slack * slack * max(float(headers[r][1]) for r in contributors) + 1e-12

    def place(r: int) -> None:
        piece = codec.decode(gathered[r], chunk)
        piece_norm = float(piece.norm())
        if not math.isfinite(piece_norm) or piece_norm > bound:
            raise CollectiveError(f"rank {r} sent a mean chunk larger than any input (norm {piece_norm:.3g})",
                                  "gather", blame=[r])
        mean[r * chunk:(r + 1) * chunk] = piece

    # place(rank) decodes the member's own chunk from the encoded bytes, like everyone else's.
    ring_gather(pg, gathered, "gather", 2, place, ring, piece, pacer)
    return _Stripe(mean[:total], torch.cat(gathered), chunk, (world - 1) * encoded * 2)
