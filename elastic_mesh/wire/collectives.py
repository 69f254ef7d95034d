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
from elastic_mesh.wire.pacing import (
    MAX_SPREAD_S,
    MIN_SPREAD_S,
    Pacer,
    PiecewiseSend,
    piece_bytes,
    pieces,
)
from elastic_mesh.wire.socket_pacing import GroupSockets
from elastic_mesh.wire.topology import LinkEstimates, choose_ring, rate_matrix


class CollectiveError(RuntimeError):
    """A transfer failed (a peer died, timed out or sent bad data); `blame` names ranks at fault, if known."""

    def __init__(self, message: str, phase: str, blame: list[int] | None = None) -> None:
        super().__init__(message)
        self.phase, self.blame = phase, blame or []


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


def decode_wire(wire: torch.Tensor, codec: Codec | str, layout: list[list[int]]) -> torch.Tensor:
    """The mean an all-reduce produced, from its `wire` bytes (what each member computed, bit for bit).
    codec: the one it was encoded with, or its name."""
    codec = codec_for(codec) if isinstance(codec, str) else codec
    out, offset = [], 0
    for chunk, elements, world in layout:
        encoded = codec.encoded_size(chunk)
        pieces = [codec.decode(wire[offset + r * encoded:offset + (r + 1) * encoded], chunk) for r in range(world)]
        out.append(torch.cat(pieces)[:elements])
        offset += encoded * world
    return torch.cat(out) if out else torch.zeros(0)


def _wait(work, phase: str) -> None:
    try:
        work.wait()
    except RuntimeError as e:  # Gloo reports a dead or silent peer as RuntimeError/DistBackendError
        raise CollectiveError(f"{phase} failed: {e}", phase) from e


def _post(start: Callable[[], object], phase: str):
    """Starts a send/recv/allgather. Gloo can raise while posting (a peer that already closed its
    connection), not only while waiting: that is the same failure and must reach callers the same way."""
    try:
        return start()
    except RuntimeError as e:
        raise CollectiveError(f"{phase} failed: {e}", phase) from e


class _TimedReceive:
    """A receive announced by a 4-byte marker the sender puts on the same connection just before the
    data: the time from marker to data is how long the data took on this pair, without the latency
    or the wait for the sender to get to this step. A thread waits on both, so the times are taken
    when they happen rather than when the caller gets round to looking."""

    def __init__(self, pg: dist.ProcessGroup, frm: int, buffer: torch.Tensor, phase: str, tag: int,
                 piece: int = 0) -> None:
        self.frm, self.nbytes, self.phase = frm, buffer.numel() * buffer.element_size(), phase
        self.marker = _post(lambda: pg.recv([torch.empty(1)], frm, tag + _MARKER_TAG), phase)
        self.data = _receive(pg, buffer, frm, tag, phase, piece)
        self.seconds, self.error = float("nan"), None
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"receive-from-{frm}")
        self._thread.start()

    def _run(self) -> None:
        try:
            self.marker.wait()
            started = time.perf_counter()
            for work in self.data:
                work.wait()
            self.seconds = time.perf_counter() - started
        except RuntimeError as e:
            self.error = e

    def wait(self) -> None:
        self._thread.join()
        if self.error is not None:
            raise CollectiveError(f"{self.phase} failed: {self.error}", self.phase) from self.error


_MARKER_TAG = 100


def _receive(pg: dist.ProcessGroup, buffer: torch.Tensor, frm: int, tag: int, phase: str, piece: int) -> list:
    """Posts the receives of one transfer, a piece each, as the sender cuts it."""
    return [_post(lambda: pg.recv([view], frm, tag), phase) for view in pieces(buffer, piece)]


def _send(pg: dist.ProcessGroup, buffer: torch.Tensor, to: int, tag: int, phase: str, piece: int,
          pacer: Pacer | None) -> PiecewiseSend:
    return PiecewiseSend(lambda view: _post(lambda: pg.send([view], to, tag), phase), lambda w: _wait(w, phase),
                         buffer, piece, pacer, name=f"{phase}-send-to-{to}")


def _pairwise(pg: dist.ProcessGroup, outgoing, incoming, phase: str, tag: int,
              arrived: Callable[[int], None], order: list[int],
              timed: Callable[[int, int, float], None] | None = None, slow: set[int] | None = None,
              piece: int = 0, pacer: Pacer | None = None) -> None:
    """Sends a distinct buffer to every other member: in step s a member sends to the one s places on
    along the ring `order` (so it receives from the one s places back). Sends go one at a time, so
    each uplink carries one flow and each downlink mostly one (posting every send at once, as Gloo's
    all-to-all does, makes N-1 senders converge on each receiver's downlink: on a WAN, queue
    overflow, losses and collapsing TCP windows). Receives are all posted up front, so a step never
    waits for the slower direction of the one before; each arrival is decoded (`arrived`) while later
    transfers are on the wire, and timed: timed(sender, bytes, seconds) for every pair. Transfers move
    in pieces of `piece` bytes (0: whole), posted at the `pacer`'s rate if there is one."""
    rank, world = pg.rank(), pg.size()
    at, slow = order.index(rank), slow or set()
    receiving = [_TimedReceive(pg, order[(at - s) % world], incoming(order[(at - s) % world]), phase, tag, piece)
                 for s in range(1, world)]
    marker = torch.zeros(1)

    def send(to: int) -> tuple:
        announced = _post(lambda: pg.send([marker], to, tag + _MARKER_TAG), phase)
        return announced, _send(pg, outgoing(to), to, tag, phase, piece, pacer)

    # Peers behind a slow route get their transfer at once, alongside the others: one at a time, a
    # slow transfer would hold up every later step (its rate is the route's, so it takes little of the
    # uplink from the transfers it runs beside). Their incoming transfers are waited for last.
    slow_sends = [send(to) for to in (order[(at + s) % world] for s in range(1, world)) if to in slow]
    arrived(rank)  # the member's own piece, while the first transfer is on the wire
    later = []
    for step in range(1, world):
        to = order[(at + step) % world]
        sending = () if to in slow else send(to)
        if step + 1 < world:
            outgoing(order[(at + step + 1) % world])  # prepare the next buffer meanwhile
        receive = receiving[step - 1]
        if receive.frm in slow:
            later.append(receive)
        else:
            _finish(receive, arrived, timed)
        _finish_send(sending, phase)
    for receive in later:
        _finish(receive, arrived, timed)
    for sending in slow_sends:
        _finish_send(sending, phase)


def _finish_send(sending: tuple, phase: str) -> None:
    if sending:
        announced, data = sending
        _wait(announced, phase)
        data.wait()


def _finish(receive: _TimedReceive, arrived: Callable[[int], None],
            timed: Callable[[int, int, float], None] | None) -> None:
    receive.wait()
    arrived(receive.frm)
    if timed:
        timed(receive.frm, receive.nbytes, receive.seconds)


def slow_peers(rank: int, rates: list[list[float]] | None, factor: float = 0.5) -> set[int]:
    """Members the route to or from is slower than `factor` × the median route (measured)."""
    if not rates:
        return set()
    world = len(rates)
    values = sorted(rates[i][j] for i in range(world) for j in range(world) if i != j)
    bar = factor * values[len(values) // 2]
    return {j for j in range(world) if j != rank and min(rates[rank][j], rates[j][rank]) < bar}


def _ring_gather(pg: dist.ProcessGroup, chunks: list[torch.Tensor], phase: str, tag: int,
                 arrived: Callable[[int], None], order: list[int], piece: int = 0, pacer: Pacer | None = None) -> None:
    """All-gather on the ring `order`: in step s a member forwards the chunk it got s-1 steps ago to
    its right-hand neighbour and receives one from its left. Every member uploads N-1 chunks over one
    connection that stays busy (its TCP window stays open), and decodes each chunk while the next
    one is on the wire. All hops move at once: the ring goes at its slowest hop's rate."""
    rank, world = pg.rank(), pg.size()
    at = order.index(rank)
    right, left = order[(at + 1) % world], order[(at - 1) % world]
    done = rank
    for step in range(1, world):
        sending = _send(pg, chunks[order[(at - step + 1) % world]], right, tag, phase, piece, pacer)
        receiving = _receive(pg, chunks[order[(at - step) % world]], left, tag, phase, piece)
        arrived(done)
        for work in receiving:
            _wait(work, phase)
        sending.wait()
        done = order[(at - step) % world]
    arrived(done)


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
    rank, world = groups[0].rank(), groups[0].size()
    x = x.detach().reshape(-1).float().cpu()
    norm = float(x.norm()) if x.numel() else 0.0
    finite = valid and math.isfinite(norm)
    peers = peers or [str(r) for r in range(world)]
    header = torch.tensor([1.0 if finite else 0.0, norm if finite else 0.0, 1.0 if contributes[rank] else 0.0,
                           float(x.numel()), 1.0 if links else 0.0,
                           *(links.incoming(peers) if links else [0.0] * world),
                           *(links.last_ring(peers) if links else range(world)), spread_s or 0.0])
    headers = [torch.empty(header_size(world)) for _ in range(world)]
    _wait(_post(lambda: groups[0].allgather([headers], [header]), "header"), "header")
    sizes = {int(h[3]) for h in headers}
    if len(sizes) != 1:
        raise CollectiveError(f"members disagree on the tensor size: {sorted(sizes)}", "header")
    ring, rates = _agree_on_ring(headers, world)
    # What each member sends (both phases), paced to the agreed spread, in pieces everyone cuts alike.
    to_send = 2 * (world - 1) * codec.encoded_size(-(-x.numel() // world))
    spread = _agree_on_spread(headers)
    pace = to_send / spread if spread and world > 1 and to_send else None
    piece = piece_bytes(pace) if pace else 0
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
    total = x.numel()
    if not contributors or total == 0:
        return AllReduceResult(torch.zeros_like(x), contributors, refused, seconds=time.perf_counter() - started)
    # Stripes of whole blocks (the int8 scales cover BLOCK elements), as even as that allows.
    per_stripe = -(-(-(-total // len(groups))) // BLOCK) * BLOCK
    bounds = [(start, min(total, start + per_stripe)) for start in range(0, total, per_stripe)]
    stripes: list[_Stripe | None] = [None] * len(bounds)
    errors: list[CollectiveError] = []
    phases_done = threading.Barrier(len(bounds))
    slow = slow_peers(rank, rates)
    # Only stripe 0 is timed: with S stripes each sees about 1/S of a route, enough to tell the slow ones.
    timed = (lambda frm, nbytes, seconds: links.observe(peers[frm], nbytes, seconds)) if links else None
    # The bucket paces each member's sends in all; each connection gets its stripe's share as a cap.
    capped = [s for s in (sockets or [])[:len(bounds)] if s is not None] if pace else []

    def cap(rate: float | None) -> int:
        return sum(s.pace(None if rate is None else rate / len(bounds)) for s in capped)
    pacer = Pacer(pace, to_send, on_rate=cap, end_s=finish_s) if pace else None

    def run(i: int) -> None:
        def after_scatter() -> None:
            try:
                phases_done.wait()  # on_phase("scatter") comes once every stripe's scatter is done
            except threading.BrokenBarrierError:  # another stripe failed; its error is the one raised
                return
            if i == 0 and on_phase:
                on_phase("scatter")
        try:
            start, end = bounds[i]
            stripes[i] = _reduce_stripe(groups[i], x[start:end], codec, contributors, headers, after_scatter,
                                        ring, timed if i == 0 else None, slow, piece, pacer)
        except CollectiveError as e:
            errors.append(e)
            phases_done.abort()
        except Exception as e:  # any other failure of one stripe fails the whole all-reduce, named
            errors.append(CollectiveError(f"stripe {i}: {type(e).__name__}: {e}", "scatter"))
            phases_done.abort()

    try:
        kernel_paced = cap(pace) if capped else 0
        threads = [threading.Thread(target=run, args=(i,), daemon=True, name=f"all-reduce-stripe-{i}")
                   for i in range(1, len(bounds))]
        for t in threads:
            t.start()
        run(0)
        for t in threads:
            t.join()
    finally:
        if capped:  # the group's next, unpaced all-reduce goes at the link's rate
            cap(None)
    if errors:
        blamed = [e for e in errors if e.blame]
        raise (blamed or errors)[0]
    if on_phase:
        on_phase("gather")
    # Both phases, the headers and the 4-byte markers that time each scatter transfer.
    moved = sum(st.moved for st in stripes) + (world - 1) * (4 * header_size(world) + 4 * len(stripes))
    return AllReduceResult(torch.cat([st.mean for st in stripes]), contributors, refused, moved, moved,
                           time.perf_counter() - started, wire=torch.cat([st.wire for st in stripes]),
                           layout=[[st.chunk, st.mean.numel(), world] for st in stripes], ring=ring,
                           ring_changed=ring_changed, rates=rates, kernel_paced=kernel_paced)


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

    _pairwise(pg, encoded_chunk, lambda peer: recv[peer * encoded:(peer + 1) * encoded], "scatter", 1, accumulate,
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
    _ring_gather(pg, gathered, "gather", 2, place, ring, piece, pacer)
    return _Stripe(mean[:total], torch.cat(gathered), chunk, (world - 1) * encoded * 2)
