"""Held-out reward of chosen policy versions, measured by the orchestrator on a thread of its own
(never on a request's path); a result at or above stop_at_reward ends the run."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

from prime.inference.hf_engine import HFEngine
from prime.rl.environments.base import Environment
from prime.rl.environments.evaluation import evaluate
from prime.rl.orchestrator.core import Orchestrator
from prime.rl.orchestrator.versions import VerifiedVersions

log = logging.getLogger("prime.rl.orchestrator")


class Evaluations:
    def __init__(self, orchestrator: Orchestrator, versions: VerifiedVersions, env: Environment,
                 record: Callable[[dict], None]) -> None:
        self.orchestrator, self.versions, self.env, self.record = orchestrator, versions, env, record
        self.tasks = list(env.tasks("eval", orchestrator.config.seed))
        self.todo: queue.Queue[int] = queue.Queue()
        self.results: list[dict] = []
        self.last = -1
        threading.Thread(target=self._run, daemon=True, name="evaluations").start()

    def _run(self) -> None:
        while True:
            self.evaluate(self.todo.get())

    def evaluate(self, version: int) -> dict | None:
        """The held-out reward of `version` (None: it is not held here any more)."""
        try:
            model = self.versions.model(version)
        except KeyError:
            return None
        engine = HFEngine(model, pad_id=self.versions.tokenizer.pad_token_id)  # no proofs: nobody checks these
        reward = evaluate(engine, self.env, self.versions.tokenizer, self.tasks, self.orchestrator.config.max_tokens)
        result = {"event": "eval", "version": version, "time_s": self.orchestrator.elapsed(), "eval_reward": reward}
        self.results.append(result)
        self.last = max(self.last, version)
        self.record(result)
        log.info("version %d: held-out reward %.3f", version, reward)
        target = self.orchestrator.config.stop_at_reward
        if target is not None and reward >= target and not self.orchestrator.done:
            log.info("held-out reward %.3f reached the target %.3f: ending the run", reward, target)
            self.orchestrator.finish(version)
        return result
