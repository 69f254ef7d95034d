"""What an RL task source is: prompts to hand out, and a verifier that scores a completion.

The orchestrator (trusted) computes every reward itself with `Environment.reward`; nothing a worker
says about its own rollout's quality is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Literal, Protocol

Split = Literal["train", "eval"]


@dataclass(frozen=True)
class Task:
    """One prompt and what its verifier needs to score an answer (never shown to workers)."""

    id: str
    prompt: str
    answer: str
    info: dict = field(default_factory=dict)


class Environment(Protocol):
    name: str

    def tasks(self, split: Split, seed: int) -> Iterator[Task]:
        """An endless (train) or fixed (eval) stream of tasks, the same for the same seed."""
        ...

    def reward(self, task: Task, completion: str) -> float:
        """The completion's reward in [0, 1], from the task's own verifier."""
        ...
