"""Procedural tasks from `reasoning-gym` (offline: every task is generated from a seed), scored by the
dataset's own `score_answer`. Train and eval draw from the same generator with different seeds."""

from __future__ import annotations

from typing import Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field

from prime.rl.environments.base import Split, Task


class ReasoningGymConfig(BaseModel):
    """A reasoning-gym dataset by name, with its own options."""

    model_config = ConfigDict(extra="forbid")

    name: Literal["reasoning-gym"] = "reasoning-gym"

    dataset: str = Field("basic_arithmetic", description="reasoning_gym.create_dataset name, e.g. basic_arithmetic, "
                         "chain_sum, word_sorting.")
    options: dict = Field(default_factory=dict, description="The dataset's own settings (its config class fields).")
    size: int = Field(10_000, gt=0, description="Train tasks generated per pass (then the stream starts over).")
    eval_tasks: int = Field(64, gt=0, description="Held-out tasks, from another seed.")


class ReasoningGym:
    name = "reasoning-gym"

    def __init__(self, config: ReasoningGymConfig | None = None) -> None:
        import reasoning_gym

        self.config = config or ReasoningGymConfig()
        self._create = reasoning_gym.create_dataset
        try:
            self._scorer = self._create(self.config.dataset, size=1, seed=0, **self.config.options)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"reasoning-gym dataset {self.config.dataset!r} with options {self.config.options}: {e}") from None

    def tasks(self, split: Split, seed: int) -> Iterator[Task]:
        size = self.config.size if split == "train" else self.config.eval_tasks
        offset = 0 if split == "train" else 1_000_003  # held-out tasks come from a seed the train stream never uses
        passes = 0
        while True:
            data = self._create(self.config.dataset, size=size, seed=seed + offset + passes, **self.config.options)
            for index in range(size):
                entry = data[index]
                yield Task(id=f"{split}-{passes}-{index}", prompt=str(entry["question"]), answer=str(entry["answer"]),
                           info={"entry": entry})
            if split == "eval":
                return
            passes += 1

    def reward(self, task: Task, completion: str) -> float:
        score = self._scorer.score_answer(answer=completion.strip(), entry=task.info["entry"])
        return float(min(1.0, max(0.0, score)))
