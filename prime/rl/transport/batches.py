"""How the trainer gets each step's batch: one small interface, and its implementation over the
orchestrator's HTTP endpoints."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from elastic_mesh import CoordinatorClient


class BatchSource(Protocol):
    def get(self, step: int, prefetch: bool = True) -> dict | None:
        """The batch of `step` (rows, temperature, stats); None: the run is over. prefetch: the next
        step's may be asked for meanwhile."""

    def finish(self, version: int) -> None:
        """The trainer is done; `version` is its last."""

    def close(self) -> None: ...


class OrchestratorBatches:
    """BatchSource over the orchestrator. Asks for the next step's batch while this one trains: the
    request and the batch's way back (a round trip and the rows over the WAN, 0.11 s a step measured
    beyond the orchestrator's own wait) then overlap training instead of following it. Each request
    tells the orchestrator to keep the last `keep` batches (the checkpoint interval + 1), so a trainer
    restarted from its last checkpoint still finds every batch it asks for."""

    def __init__(self, orchestrator: CoordinatorClient, keep: int) -> None:
        self.orchestrator, self.keep = orchestrator, keep
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="next-batch")
        self._ahead: tuple[int, Future] | None = None

    def get(self, step: int, prefetch: bool = True) -> dict | None:
        if self._ahead is not None and self._ahead[0] == step:
            pending = self._ahead[1]
        else:
            pending = self._pool.submit(self._ask, step)
        self._ahead = None
        batch = pending.result()
        if batch is not None and prefetch:
            self._ahead = (step + 1, self._pool.submit(self._ask, step + 1))
        return batch

    def _ask(self, step: int) -> dict | None:
        while True:  # "wait": the orchestrator held the request for its poll time; ask again
            answer = self.orchestrator.post("/v1/rl/batch", {"step": step, "keep": self.keep})
            if answer.get("status") == "ok":
                return answer
            if answer.get("status") == "done":
                return None

    def finish(self, version: int) -> None:
        self.orchestrator.post("/v1/rl/finish", {"version": version})

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
