"""The worker's conversation with the orchestrator: leases asked for ahead (LeasesAhead), rollouts sent
in the background (Submitter), what each answer means for the worker's life (exit_code), and the wire
form of a completion."""

from __future__ import annotations

import base64
import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from elastic_mesh import CoordinatorClient, CoordinatorError
from prime.inference.engine import Completion
from prime.rl.transport.weights import WeightFollower
from prime.rl.worker.clock import WorkerClock

log = logging.getLogger("prime.rl.worker")

EXIT_DONE, EXIT_REFUSED, EXIT_EVICTED = 0, 2, 3


class LeasesAhead:
    """Asks the orchestrator for the next lease while the worker generates and submits this one. A lease
    request is a round trip to the orchestrator, and in line it took a worker longer than generating a
    lease's rollouts (0.11 s against 0.04 s a lease, 10 ms links): one request is kept on its way after
    each lease granted, as long as a lease takes this worker under a quarter of the lease's time (a lease
    asked ahead starts its clock while the worker is still busy with the last one: a slow worker would see
    its leases expire). What the worker waited for a lease is counted as lease_s (or waiting_s when the
    answer was not a lease)."""

    def __init__(self, orchestrator: CoordinatorClient, held: WeightFollower, stats: WorkerClock) -> None:
        """held: the versions this worker holds (each request names the newest)."""
        self.orchestrator, self.held, self.stats = orchestrator, held, stats
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lease")
        self._ahead: Future | None = None
        self._last_granted: float | None = None  # when the last lease was handed to the worker

    def _ask(self) -> tuple[dict | None, CoordinatorError | None]:
        try:
            return self.orchestrator.post("/v1/rl/lease", {"held": self.held.newest}), None
        except CoordinatorError as e:
            return None, e

    def next(self) -> dict:
        """The orchestrator's answer to a lease request (raises CoordinatorError as its post does). After a
        lease granted, the next request goes out at once; after any other answer the next is asked in line
        (a "fetch" or "wait" must be acted on first, "done" ends the worker)."""
        waited = time.monotonic()
        pending, self._ahead = self._ahead, None
        answer, error = (pending or self._pool.submit(self._ask)).result()
        if error is not None:
            raise error
        granted = answer.get("status") == "ok"
        now = time.monotonic()
        self.stats.add("lease_s" if granted else "waiting_s", now - waited)
        if granted:
            # The last lease's whole turn (generating, waiting to submit, asking for this one).
            took = now - self._last_granted if self._last_granted is not None else None
            self._last_granted = now
            if took is not None and took < float(answer.get("lease_s", 0)) / 4:
                self._ahead = self._pool.submit(self._ask)
        return answer

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Submitter:
    """Sends each lease's rollouts in the background, up to `in_flight` submissions at a time, so the
    worker leases and generates the next leases while the orchestrator verifies the last ones. A
    submission is answered only once verified, and that is most of its time: with one in flight a worker
    waited 46% of its time for the last answer (async 2, 10 ms links), and each lease asked ahead aged
    meanwhile. The leases stay the worker's until their rollouts arrive, so the orchestrator hands out
    no more work for them; verification runs in parallel there (one server thread per request)."""

    def __init__(self, orchestrator: CoordinatorClient, stats: WorkerClock, in_flight: int = 2) -> None:
        if in_flight < 1:
            raise ValueError(f"in_flight must be at least 1, not {in_flight}")
        self.orchestrator, self.stats, self.in_flight = orchestrator, stats, in_flight
        self._pool = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="submit")
        self._pending: deque[Future] = deque()  # oldest first

    def submit(self, lease: str, body: dict, rollouts: int) -> int | None:
        """Sends this submission once fewer than `in_flight` are unanswered (waiting for the oldest). An
        exit code when an answer ended this worker (evicted, refused, the orchestrator gone)."""
        ended = self.ended()
        while ended is None and len(self._pending) >= self.in_flight:
            ended = self._wait_oldest()
        if ended is None:
            self._pending.append(self._pool.submit(self._send, lease, body, rollouts))
        return ended

    def ended(self) -> int | None:
        """The exit code of a submission that has been answered and ended this worker, without waiting."""
        while self._pending and self._pending[0].done():
            ended = self._wait_oldest()
            if ended is not None:
                return ended
        return None

    def wait(self) -> int | None:
        """Waits for every submission's answer; the exit code of the first that ended this worker."""
        ended = None
        while self._pending:
            answer = self._wait_oldest()
            ended = answer if ended is None else ended
        return ended

    def _wait_oldest(self) -> int | None:
        waited = time.monotonic()
        ended = self._pending.popleft().result()
        self.stats.add("submit_s", time.monotonic() - waited)
        return ended

    def _send(self, lease: str, body: dict, rollouts: int) -> int | None:
        try:
            result = self.orchestrator.post("/v1/rl/submit", body)
        except CoordinatorError as e:
            return exit_code(e, "submit")
        if result.get("status") == "accepted":
            self.stats.accepted(rollouts)
        elif result.get("status") == "rejected":  # an honest worker sees this about once in a thousand rollouts
            log.warning("lease %s: refused, %s (evidence against this worker %s; it is evicted at the orchestrator's "
                        "limit)", lease, str(result.get("detail", ""))[:300], result.get("evidence"))
        else:
            log.info("lease %s: %s", lease, result.get("status"))
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def to_wire(completion: Completion, dtype: str) -> dict:
    return {"tokens": completion.tokens, "logprobs": completion.logprobs, "finish_reason": completion.finish_reason,
            "proof": base64.b64encode(completion.proof).decode(), "compute_dtype": dtype}


def give_back(orchestrator: CoordinatorClient, lease: str, reason: str) -> int | None:
    """Hands a lease back unworked; an exit code when the answer ends this worker."""
    try:
        orchestrator.post("/v1/rl/give-back", {"lease": lease, "reason": reason})
    except CoordinatorError as e:
        return exit_code(e, "give-back")
    return None


def exit_code(error: CoordinatorError, what: str) -> int:
    """What a refused or failed request (`what`: lease, submit, give-back) means for this worker."""
    if error.status == 403 and "evicted" in str(error):
        log.error("evicted by the orchestrator: %s", error)
        return EXIT_EVICTED
    if error.status in (401, 403):
        log.error("the orchestrator refused this worker's %s: %s", what, error)
        return EXIT_REFUSED
    log.error("the orchestrator is gone (%s): %s; assuming the run is over", what, error)
    return EXIT_DONE
