"""The paced sender on its own. The transport here is a stand-in (a list of posted pieces and events
that a test completes), because the property under test is what the sender does while Gloo holds its
pieces back, which a real Gloo pair only shows when a receiver is late; the real-Gloo pacing tests are
in test_collectives.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from elastic_mesh.wire.pacing import CATCH_UP, OUTSTANDING, Pacer, PiecewiseSend


class _HeldBackTransport:
    """Posts succeed at once; a piece 'leaves' only when the test releases it (as Gloo holds a send
    until the receiver has posted its receive). Counts waits per piece: Gloo allows one."""

    def __init__(self) -> None:
        self.posted: list[int] = []
        self.left: list[threading.Event] = []
        self.waits: dict[int, int] = {}

    def post(self, view: torch.Tensor) -> int:
        self.posted.append(view.numel())
        self.left.append(threading.Event())
        return len(self.posted) - 1

    def wait_for(self, work: int) -> None:
        self.waits[work] = self.waits.get(work, 0) + 1
        assert self.left[work].wait(10), "waited for a piece that never left"


def test_a_late_receiver_releases_at_most_the_outstanding_pieces_at_once():
    transport = _HeldBackTransport()
    buffer = torch.zeros(100 * 1024, dtype=torch.uint8)
    send = PiecewiseSend(transport.post, transport.wait_for, buffer, 10 * 1024, Pacer(10e6), name="test")
    time.sleep(0.3)  # at 10 MB/s every piece would have been posted by now: the receiver is what holds them
    assert len(transport.posted) == OUTSTANDING
    for event in transport.left:  # the receiver shows up: the held pieces go, and the pacer sets the rest
        event.set()
    deadline = time.monotonic() + 5
    while len(transport.posted) < 10 and time.monotonic() < deadline:
        for event in transport.left:
            event.set()
        time.sleep(0.01)
    for event in transport.left:
        event.set()
    send.wait()
    assert sum(transport.posted) == buffer.numel()
    assert set(transport.waits.values()) == {1}, "a piece was waited for more than once (Gloo would hang)"


def test_a_stalled_pacer_does_not_catch_up_in_a_burst():
    pacer = Pacer(1e6)
    pacer.take(100_000)  # a 0.1 s slot, then the sender is away for 0.3 s
    time.sleep(0.3)
    started = time.monotonic()
    for _ in range(3):
        pacer.take(100_000)
    assert time.monotonic() - started >= 0.18, "the time the sender was away was spent as a burst"


def test_a_pacer_behind_its_deadline_makes_up_the_time_over_what_is_left():
    """400 KB at 1 MB/s is due in 0.4 s; away for 0.3 s after the first 100 KB, the pacer raises its
    rate (and tells the kernel's caps) so as to end near the deadline, but only to CATCH_UP × the plan."""
    rates = []
    pacer = Pacer(1e6, total_bytes=400_000, on_rate=rates.append)
    pacer.take(100_000)
    time.sleep(0.3)
    started = time.monotonic()
    for _ in range(3):
        pacer.take(100_000)
    assert rates == [CATCH_UP * 1e6], rates
    assert time.monotonic() - started >= 0.9 * 2 * 100_000 / (CATCH_UP * 1e6), "made up in a burst"


def test_a_pacer_with_slack_keeps_its_planned_rate_until_the_slack_is_spent():
    """The same pause with 0.5 s of slack after the planned 0.4 s: the lost 0.3 s come out of the slack,
    so the rest goes at the plan's rate (no burst at all); with 0.1 s of slack it must speed up."""
    for slack_s, expected in ((0.5, []), (0.1, [CATCH_UP * 1e6])):
        rates = []
        pacer = Pacer(1e6, total_bytes=400_000, on_rate=rates.append, end_s=0.4 + slack_s)
        pacer.take(100_000)
        time.sleep(0.3)
        started = time.monotonic()
        for _ in range(3):
            pacer.take(100_000)
        assert rates[:1] == expected, (slack_s, rates)
        if not expected:
            assert time.monotonic() - started >= 0.9 * 2 * 100_000 / 1e6, "did not keep the planned rate"


def test_unpaced_sends_post_every_piece_at_once():
    transport = _HeldBackTransport()
    send = PiecewiseSend(transport.post, transport.wait_for, torch.zeros(50, dtype=torch.uint8), 16, None)
    assert transport.posted == [16, 16, 16, 2]
    for event in transport.left:
        event.set()
    send.wait()


def test_a_pace_must_be_positive():
    with pytest.raises(ValueError, match="positive rate"):
        Pacer(0)
