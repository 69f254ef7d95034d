"""Where an inference worker's time goes, written where a benchmark reads it."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Protocol


class Timed(Protocol):
    def times(self) -> dict[str, dict[int, float]]:
        """announced_at, fetched_at, loaded_at: version -> wall clock."""


class WorkerClock:
    """Where this worker's time goes, written to worker.json after every accepted submission (read by
    launch/bench/rl_async.py): generating (busy_s), asking for a lease that came (lease_s) or did not
    (waiting_s), waiting for the answer to the previous submission before sending the next (submit_s:
    the orchestrator verifies before it answers; sent in the background meanwhile), fetching a version
    it was told to (fetching_s), and when each version was announced, fetched and usable here
    (announced_at, fetched_at, loaded_at: wall clock)."""

    def __init__(self, path: Path, held: "Timed") -> None:
        """held: where the versions' times come from (the worker's PolicyFollower)."""
        self.path, self.held = path, held
        self.rollouts, self.started = 0, time.monotonic()
        self.seconds = {"busy_s": 0.0, "lease_s": 0.0, "waiting_s": 0.0, "submit_s": 0.0, "fetching_s": 0.0}
        self._lock = threading.Lock()  # submissions are answered on several threads

    def add(self, what: str, seconds: float) -> None:
        with self._lock:
            self.seconds[what] += seconds

    def accepted(self, rollouts: int) -> None:
        with self._lock:
            self.rollouts += rollouts
        self.write()

    def write(self) -> None:
        times = self.held.times()
        with self._lock:
            staging = self.path.with_suffix(".json.tmp")
            staging.write_text(json.dumps({"rollouts": self.rollouts,
                                           "seconds": round(time.monotonic() - self.started, 3),
                                           **{k: round(v, 3) for k, v in self.seconds.items()}, **times}))
            staging.replace(self.path)

    def summary(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return f"{self.rollouts} rollouts in {elapsed:.0f} s (" + ", ".join(
            f"{k.removesuffix('_s')} {100 * v / elapsed:.0f}%" for k, v in self.seconds.items()) + ")"
