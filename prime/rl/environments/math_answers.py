"""Math problems from a local jsonl in the NuminaMath format (`problem`, `solution`, optional `answer`),
checked with `math-verify`: the gold answer is `answer` when given, else the solution's last \\boxed{};
a completion is right when math-verify finds an equivalent answer in it (LaTeX or plain, boxed or not)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field

from prime.rl.environments.base import Split, Task


class MathConfig(BaseModel):
    """A NuminaMath-style jsonl on local disk; a hash of each problem puts a tenth of them in eval."""

    model_config = ConfigDict(extra="forbid")

    name: Literal["math"] = "math"

    path: Path = Field(description="jsonl with one {problem, solution[, answer]} object per line.")
    prompt_suffix: str = Field(" Put the final answer in \\boxed{}.", description="Appended to every problem.")
    eval_tasks: int = Field(64, gt=0, description="Held-out problems at most.")


class MathAnswers:
    name = "math"

    def __init__(self, config: MathConfig) -> None:
        import math_verify

        self.config, self._verify, self._parse = config, math_verify.verify, math_verify.parse
        self.train: list[Task] = []
        self.eval: list[Task] = []
        for number, line in enumerate(Path(config.path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                problem = str(row["problem"])
                gold = str(row.get("answer") or "") or str(row["solution"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{config.path}:{number}: not a NuminaMath row ({e})") from None
            if not self._parse(_as_math(gold)):
                raise ValueError(f"{config.path}:{number}: math-verify finds no answer in {gold[:80]!r}")
            digest = hashlib.sha256(problem.encode()).hexdigest()[:12]
            held_out = int(digest, 16) % 10 == 0 and len(self.eval) < config.eval_tasks
            split = "eval" if held_out else "train"
            (self.eval if held_out else self.train).append(
                Task(id=f"{split}-{digest}", prompt=problem + config.prompt_suffix, answer=gold))
        if not self.train:
            raise ValueError(f"{config.path} holds no training problems")

    def tasks(self, split: Split, seed: int) -> Iterator[Task]:
        import random

        if split == "eval":
            yield from self.eval
            return
        rng = random.Random(seed)
        while True:
            order = list(self.train)
            rng.shuffle(order)
            yield from order

    def reward(self, task: Task, completion: str) -> float:
        gold = self._parse(_as_math(task.answer))
        answer = self._parse(completion)
        return 1.0 if gold and answer and self._verify(gold, answer) else 0.0


def _as_math(text: str) -> str:
    """A bare answer ("1/2") as math mode, so math-verify reads it as an expression; solutions as they are."""
    return text if "\\boxed" in text or "$" in text else f"${text}$"
