"""Paced sending, so an all-reduce that runs behind compute need not burst at the link's rate.

An all-reduce that runs behind the caller's compute has a whole window to move its bytes. Sent at the link's
rate it fills the link for a few seconds and then leaves it idle; a link shared with other traffic
(or billed, or policed, at its peak) is better served by the same bytes spread over the window. So a
member may cut every transfer into pieces and post each piece only when a token bucket allows: the
bytes enter the kernel at the paced rate and leave it no faster. Both ends must cut a transfer alike
(each piece is one send matched by one receive), so the piece size follows from the spread the
members agree on in the all-reduce's header.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable

import torch

MIN_SPREAD_S, MAX_SPREAD_S = 0.1, 3600.0  # the spreads a member may ask for
MIN_PIECE = 4 << 10
MAX_PIECE = 4 << 20
PIECE_SECONDS = 0.05  # a piece takes about this long at the paced rate: smooth at the scale of a second
# Pieces a paced sender has posted and not yet seen leave. Gloo writes a piece only once the receiver
# has posted its receive, so a receiver that gets to a phase late (or a connection that stalls after
# a loss) would otherwise release every piece queued meanwhile at once, at the link's rate.
OUTSTANDING = 2
# The most a pacer behind its deadline speeds up to, as a multiple of its planned rate: enough to
# make up a pause of a third of the spread, still far from a burst at the link's rate.
CATCH_UP = 1.5


class Pacer:
    """Token bucket without a burst allowance, shared by every send of one member's all-reduce.

    Given the bytes it will pace in all, it also keeps to a deadline: the one its rate implies, or
    `end_s` from now where the sender may end later than its plan (slack before anyone waits for
    it). Time lost to a receiver late to a phase, or to the pause between the phases, is made up by
    raising the rate just enough to end by the deadline, spread over the time left (never more than
    CATCH_UP × the planned rate), not in a burst; with slack, lost time is first taken from the slack
    and the rate stays the plan's. `on_rate` hears every change of rate (the kernel's caps follow it)."""

    def __init__(self, bytes_per_s: float, total_bytes: int = 0,
                 on_rate: Callable[[float], None] | None = None, end_s: float | None = None) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"a pace must be a positive rate, got {bytes_per_s} bytes/s")
        self.bytes_per_s = self.planned = bytes_per_s
        self._next = time.monotonic()
        self._left = total_bytes
        planned_s = total_bytes / bytes_per_s
        self._end = self._next + max(planned_s, end_s or 0.0) if total_bytes > 0 else None
        self._on_rate = on_rate
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        """Waits until `nbytes` more may go out."""
        changed = None
        with self._lock:
            now = time.monotonic()
            if self._end is not None:
                rate = self._rate_to_end_on_time(now)
                if abs(rate - self.bytes_per_s) > 0.05 * self.planned:  # no system call per piece
                    self.bytes_per_s = changed = rate
                self._left -= nbytes
            start = max(now, self._next)
            self._next = start + nbytes / self.bytes_per_s
        if changed is not None and self._on_rate is not None:
            self._on_rate(changed)
        if start > now:
            time.sleep(start - now)

    def _rate_to_end_on_time(self, now: float) -> float:
        time_left = self._end - now
        needed = self._left / time_left if time_left > 0 else math.inf
        return min(CATCH_UP * self.planned, max(self.planned, needed))


def piece_bytes(bytes_per_s: float) -> int:
    """The piece size a member pacing at this rate asks for."""
    return int(min(MAX_PIECE, max(MIN_PIECE, bytes_per_s * PIECE_SECONDS)))


def pieces(buffer: torch.Tensor, piece: int) -> list[torch.Tensor]:
    """Views of a flat byte buffer, `piece` bytes each (the whole buffer when piece is 0)."""
    flat = buffer.reshape(-1)
    if piece <= 0 or flat.numel() <= piece:
        return [flat]
    return [flat[i:i + piece] for i in range(0, flat.numel(), piece)]


class PiecewiseSend:
    """One transfer as pieces. Without a pacer every piece is posted now; with one, a thread posts
    each piece when the pacer allows. wait() returns once every piece has gone out and raises the
    first failure (post and wait_for raise the caller's own error type)."""

    def __init__(self, post: Callable[[torch.Tensor], object], wait_for: Callable[[object], None],
                 buffer: torch.Tensor, piece: int, pacer: Pacer | None, name: str = "paced-send") -> None:
        self._wait_for, self._error, self._waited = wait_for, None, 0
        views = pieces(buffer, piece)
        if pacer is None:
            self._works, self._thread = [post(v) for v in views], None
            return
        self._works = []

        def run() -> None:
            try:
                for i, view in enumerate(views):
                    if i >= OUTSTANDING:  # see OUTSTANDING: a late receiver releases a burst of at most this many
                        wait_for(self._works[i - OUTSTANDING])
                        self._waited = i - OUTSTANDING + 1
                    pacer.take(view.numel())
                    self._works.append(post(view))
            except BaseException as e:  # re-raised by wait(), in the caller's thread
                self._error = e
        self._thread = threading.Thread(target=run, daemon=True, name=name)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        for work in self._works[self._waited:]:  # a Gloo send may be waited for once only
            self._wait_for(work)
