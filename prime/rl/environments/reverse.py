"""The built-in task: reverse a string of digits. Small enough for a Llama of ~0.1M parameters trained
from scratch on 2 CPU cores, and verifiable exactly, so reward curves mean something."""

from __future__ import annotations

import hashlib
import random
from typing import Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field

from prime.rl.environments.base import Split, Task


class ReverseConfig(BaseModel):
    """The built-in task: which digit strings to reverse, and how many are held out for evaluation."""

    model_config = ConfigDict(extra="forbid")

    name: Literal["reverse"] = "reverse"

    min_digits: int = Field(4, ge=1, le=64, description="Shortest digit string.")
    max_digits: int = Field(4, ge=1, le=64, description="Longest digit string.")
    eval_tasks: int = Field(64, gt=0, description="Held-out tasks in the eval split.")


class ReverseDigits:
    """Prompt "1234=", answer "4321". Reward: the fraction of answer positions right, so a half-right
    answer is worth half; digits beyond the answer's length count as wrong positions."""

    name = "reverse"

    def __init__(self, config: ReverseConfig | None = None) -> None:
        self.config = config or ReverseConfig()
        if self.config.min_digits > self.config.max_digits:
            raise ValueError("reverse: min_digits exceeds max_digits")

    def _task(self, rng: random.Random, split: Split) -> Task:
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(self.config.min_digits,
                                                                              self.config.max_digits)))
        return Task(id=f"{split}-{hashlib.sha256(digits.encode()).hexdigest()[:12]}", prompt=digits + "=",
                    answer=digits[::-1])

    def _is_eval(self, task: Task) -> bool:
        return int(task.id.split("-")[1], 16) % 10 == 0  # a tenth of all strings is held out, by hash

    def tasks(self, split: Split, seed: int) -> Iterator[Task]:
        rng = random.Random(f"{seed}-{split}")
        if split == "eval":
            for _ in range(self.config.eval_tasks):
                while True:
                    task = self._task(rng, "eval")
                    if self._is_eval(task):
                        yield task
                        break
            return
        while True:
            task = self._task(rng, "train")
            if not self._is_eval(task):
                yield task

    def reward(self, task: Task, completion: str) -> float:
        answer = task.answer
        right = sum(a == b for a, b in zip(completion, answer))
        return right / max(len(answer), len(completion))
