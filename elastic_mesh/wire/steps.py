"""The point-to-point steps an all-reduce is made of (collectives.py): a pairwise exchange in which
every member sends a distinct buffer to every other, and an all-gather around a ring; each transfer
cut into pieces a pacer may post at a rate, each arrival timed. Gloo's failures (a peer that died,
stalled or closed its connection) come out as CollectiveError, with the phase they struck in."""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from elastic_mesh.wire.pacing import Pacer, PiecewiseSend, pieces


class CollectiveError(RuntimeError):
    """A transfer failed (a peer died, timed out or sent bad data); `blame` names ranks at fault, if known."""

    def __init__(self, message: str, phase: str, blame: list[int] | None = None) -> None:
        super().__init__(message)
        self.phase, self.blame = phase, blame or []



def wait(work, phase: str) -> None:
    try:
        work.wait()
    except RuntimeError as e:  # Gloo reports a dead or silent peer as RuntimeError/DistBackendError
        raise CollectiveError(f"{phase} failed: {e}", phase) from e


def post(start: Callable[[], object], phase: str):
    """Starts a send/recv/allgather. Gloo can raise while posting (a peer that already closed its
    connection), not only while waiting: that is the same failure and must reach callers the same way."""
    try:
        return start()
    except RuntimeError as e:
        raise CollectiveError(f"{phase} failed: {e}", phase) from e


class TimedReceive:
    """A receive announced by a 4-byte marker the sender puts on the same connection just before the
    data: the time from marker to data is how long the data took on this pair, without the latency
    or the wait for the sender to get to this step. A thread waits on both, so the times are taken
    when they happen rather than when the caller gets round to looking."""

    def __init__(self, pg: dist.ProcessGroup, frm: int, buffer: torch.Tensor, phase: str, tag: int,
                 piece: int = 0) -> None:
        self.frm, self.nbytes, self.phase = frm, buffer.numel() * buffer.element_size(), phase
        self.marker = post(lambda: pg.recv([torch.empty(1)], frm, tag + MARKER_TAG), phase)
        self.data = receive_pieces(pg, buffer, frm, tag, phase, piece)
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


MARKER_TAG = 100


def receive_pieces(pg: dist.ProcessGroup, buffer: torch.Tensor, frm: int, tag: int, phase: str, piece: int) -> list:
    """Posts the receives of one transfer, a piece each, as the sender cuts it."""
    return [post(lambda: pg.recv([view], frm, tag), phase) for view in pieces(buffer, piece)]


def send_pieces(pg: dist.ProcessGroup, buffer: torch.Tensor, to: int, tag: int, phase: str, piece: int,
          pacer: Pacer | None) -> PiecewiseSend:
    return PiecewiseSend(lambda view: post(lambda: pg.send([view], to, tag), phase), lambda w: wait(w, phase),
                         buffer, piece, pacer, name=f"{phase}-send-to-{to}")


def pairwise(pg: dist.ProcessGroup, outgoing, incoming, phase: str, tag: int,
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
    receiving = [TimedReceive(pg, order[(at - s) % world], incoming(order[(at - s) % world]), phase, tag, piece)
                 for s in range(1, world)]
    marker = torch.zeros(1)

    def send(to: int) -> tuple:
        announced = post(lambda: pg.send([marker], to, tag + MARKER_TAG), phase)
        return announced, send_pieces(pg, outgoing(to), to, tag, phase, piece, pacer)

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
            finish(receive, arrived, timed)
        finish_send(sending, phase)
    for receive in later:
        finish(receive, arrived, timed)
    for sending in slow_sends:
        finish_send(sending, phase)


def finish_send(sending: tuple, phase: str) -> None:
    if sending:
        announced, data = sending
        wait(announced, phase)
        data.wait()


def finish(receive: TimedReceive, arrived: Callable[[int], None],
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


def ring_gather(pg: dist.ProcessGroup, chunks: list[torch.Tensor], phase: str, tag: int,
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
        sending = send_pieces(pg, chunks[order[(at - step + 1) % world]], right, tag, phase, piece, pacer)
        receiving = receive_pieces(pg, chunks[order[(at - step) % world]], left, tag, phase, piece)
        arrived(done)
        for work in receiving:
            wait(work, phase)
        sending.wait()
        done = order[(at - step) % world]
    arrived(done)
