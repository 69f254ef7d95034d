"""One outer step as a node takes part in it: plan, all-reduce, vote, retried until the coordinator
applies it or leaves the node out. It never touches the model or the outer params, so it can run in a
background thread (diloco.mode = delayed) while the inner steps go on."""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from elastic_mesh import AllReduceResult, CoordinatorError, ElasticDeviceMesh, RoundPlan

log = logging.getLogger(__name__)


@dataclass
class Exchange:
    """One outer step as the coordinator decided it for this node."""

    step: int
    status: str  # applied | missed | resync | dropped | skipped (an earlier step in flight was not applied)
    plan: RoundPlan | None = None
    result: AllReduceResult | None = None
    contributed: bool = False
    seconds: float = 0.0  # from the first plan to the decision, retries included
    model_hash: str = ""  # delayed: committed by the background thread
    # Where the time went, retries included: the plan's barrier, the transfer (group, agreements and
    # all-reduce), the vote; overlapped modes add the wait for the step before and the commit after.
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Pace:
    """How an overlapped outer step spreads its all-reduce: at the rate that moves its bytes in
    `spread_s`, and no faster than it must to end by `finish_by` (time.monotonic(): when the inner
    steps would start waiting for it). A step that starts late (queued behind the one before, or a
    slow plan) keeps the planned rate while the slack lasts, instead of compressing its spread."""

    spread_s: float
    finish_by: float


def plan_pace(share_s: float, fraction: float, window_s: float, overheads: list[tuple[float, float]],
              now: float) -> Pace:
    """The pace of an outer step launched at `now`: its all-reduce should take `fraction` of its share
    of the inner steps' time (`share_s`: the time between launches, or τ if shorter) within a window of
    `window_s` (τ) before the inner steps wait for it. `overheads`: recent outer steps' (plan, vote and
    commit) seconds, around their transfers. Outer steps in flight are decided one after another, so the
    whole step, not only its transfer, must fit in the share, or the next one queues behind it, starts
    late and catches up in a burst. The rest of the share (1 − fraction) is there for the plan and the
    vote and commit; only where their recent mean does not fit in it does the transfer give up the
    difference (the mean, not the longest: a step whose commit serves a whole snapshot is absorbed by
    the slack). Giving up more would only raise the rate on the wire: a member that reached the plan
    early waited there for the others, which costs the wire nothing, and the members spread over the
    longest spread any of them asks for. Never below half the planned spread. The finish-by leaves room
    for the longest recent vote and commit; before any step, a few WAN round trips are assumed."""
    overheads = overheads or [(0.5, 1.0)]
    before_s = sum(o[0] for o in overheads) / len(overheads)
    after_s = sum(o[1] for o in overheads) / len(overheads)
    spread_s = fraction * share_s
    transfer_s = max(spread_s / 2, min(spread_s, share_s - before_s - after_s))
    return Pace(transfer_s, now + max(transfer_s, window_s - max(o[1] for o in overheads)))


class InFlight:
    """An overlapped outer step, decided in a background thread while the inner steps go on. Several may
    be in flight (streaming with an overlap over H/F steps); each is decided after the one before it
    (`after`), since the coordinator commits outer steps in order."""

    def __init__(self, step: int, tokens: int, rewound: bool, fragment: int = 0,
                 launched_from: list[torch.Tensor] | None = None, apply_at: int = 0) -> None:
        self.step, self.tokens = step, tokens  # tokens: read by the window it averages
        self.rewound = rewound  # its reading was rewound already (a non-finite pseudo-gradient); else marked
        self.withheld = False  # it went out without its reading: an earlier step left the reading before it uncommitted
        self.fragment, self.launched_from = fragment, launched_from or []  # the fragment's shards at launch
        self.apply_at = apply_at  # the inner step at which the training thread applies it
        self._thread: threading.Thread | None = None
        self._exchange: Exchange | None = None
        self._error: BaseException | None = None

    def start(self, run: Callable[[bool], Exchange], after: "InFlight | None" = None) -> "InFlight":
        """run(withhold) decides the step in a background thread, once `after` (the outer step launched
        before it, if still in flight) is decided: not at all if that one was not applied (this node is
        catching up instead), and without this step's reading (withhold) if that one's reading was not
        committed: this step's report starts where that one's ends."""
        def target() -> None:
            try:
                waiting_since = time.perf_counter()
                if after is not None:
                    previous = after.settled()
                    if previous is None or previous.status != "applied":
                        self._exchange = Exchange(self.step, "skipped")
                        return
                    self.withheld = after.left_reading_uncommitted()
                queued_s = time.perf_counter() - waiting_since
                self._exchange = run(self.withheld)
                self._exchange.timings["queued_s"] = queued_s
            except BaseException as e:  # re-raised in the training thread, which owns the node's fate
                self._error = e
        self._thread = threading.Thread(target=target, daemon=True, name=f"outer-step-{self.step}")
        self._thread.start()
        return self

    def settled(self) -> Exchange | None:
        """The decision once made; None if deciding raised (the training thread re-raises it)."""
        if self._thread is not None:
            self._thread.join()
        return None if self._error is not None else self._exchange

    def decided(self) -> bool:
        """The background thread is done (the decision is in, or deciding raised): wait() will not block."""
        return self._thread is not None and not self._thread.is_alive()

    def left_reading_uncommitted(self) -> bool:
        return self.withheld or (not self.rewound and not self._exchange.contributed)

    def wait(self) -> Exchange:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._exchange


class StepClock:
    """The wall time of an inner step (median of the last few, so an outer step's wait is not counted),
    from which an overlapped outer step knows how long the compute it hides behind will take."""

    def __init__(self, window: int = 9) -> None:
        self._intervals: deque[float] = deque(maxlen=window)
        self._last: float | None = None

    def tick(self) -> None:
        now = time.monotonic()
        if self._last is not None:
            self._intervals.append(now - self._last)
        self._last = now

    def seconds(self, steps: float) -> float | None:
        """About how long `steps` inner steps take; None before any step was timed or for 0 steps."""
        if steps <= 0 or len(self._intervals) < 3:
            return None
        return steps * statistics.median(self._intervals)


def exchange(mesh: ElasticDeviceMesh, step: int, pseudo: torch.Tensor, data: list[dict], compression: str,
             outlier_factor: float, on_phase: Callable[[str], None] | None = None,
             contributes: bool = True, pace: Pace | None = None) -> Exchange:
    """Takes part in outer step `step` until the coordinator applies it (after an abort the same
    pseudo-gradient goes into a retry with the survivors) or says this node is out of it. Does not
    touch the model or the outer params: safe in a background thread (with mesh.background_view()).
    pace: spread the all-reduce's sends (see Pace) rather than burst at the link's rate."""
    started = clock = time.perf_counter()
    timings = {"plan_s": 0.0, "transfer_s": 0.0, "vote_s": 0.0}

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] += now - clock
        clock = now
    while True:
        try:
            if mesh.dropped:
                raise CoordinatorError("declared dead while it could not reach the coordinator", 410)
            plan = mesh.rounds.plan(step, contributes)
        except CoordinatorError as e:
            if not e.dropped:
                raise
            log.warning("%s was dropped by the coordinator (%s); joining again and catching up from peers",
                        mesh.name, e)
            return Exchange(step, "dropped")
        if plan.status in ("missed", "resync"):
            log.warning("%s: outer step %d %s; this round's work is dropped and the node catches up from peers",
                        mesh.name, step, "went on without this node" if plan.status == "missed" else
                        "showed this node diverged")
            return Exchange(step, plan.status, plan)
        lap("plan_s")
        result, ok, blame = None, True, []
        if on_phase:
            on_phase("go")  # a place in the round is taken: the fault hook's moment to not show up
        try:
            mesh.rounds.present(plan)
            if not mesh.agree(True):
                raise RuntimeError("another local rank failed before the transfer")
            valid = mesh.agree(bool(torch.isfinite(pseudo).all()))
            # A retry, or a plan that came late, may have less time left than the spread: it spreads
            # over what remains (a spread too short to pace is ignored by the all-reduce's agreement).
            finish_s = spread_s = None
            if pace is not None:
                finish_s = pace.finish_by - time.monotonic()
                spread_s = min(pace.spread_s, finish_s)
            result = mesh.all_reduce(plan, pseudo, compression, valid=valid, outlier_factor=outlier_factor,
                                     on_phase=on_phase, spread_s=spread_s, finish_s=finish_s)
        except RuntimeError as e:  # a failed transfer (CollectiveError), the coordinator's refusal, Gloo's own
            ok, blame = False, getattr(e, "blame", [])
            log.warning("%s: outer step %d attempt %d failed: %s", mesh.name, step, plan.attempt,
                        str(e).splitlines()[0][:200])
        ok = mesh.agree(ok)
        lap("transfer_s")
        refused = result.refused if result else {}
        seconds = result.seconds if result else 0.0
        try:
            decision = mesh.rounds.vote(plan, ok, refused, blame, seconds, {"data": data})
        except CoordinatorError as e:
            if not e.dropped:
                raise
            log.warning("%s was dropped during outer step %d (%s); joining again", mesh.name, step, e)
            return Exchange(step, "dropped")
        lap("vote_s")
        if decision == "apply" and ok:
            break
        mesh.drop_group(plan.epoch)
        log.warning("%s: outer step %d will be retried with the pseudo-gradients kept", mesh.name, step)
    for rank, why in result.refused.items():
        log.warning("%s: outer step %d refused %s's pseudo-gradient: %s", mesh.name, step,
                    plan.members[rank]["name"], why)
    return Exchange(step, "applied", plan, result, plan.rank in result.contributors,
                    seconds=time.perf_counter() - started, timings=timings)
