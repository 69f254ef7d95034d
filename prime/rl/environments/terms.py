"""Optional reward terms on top of a task's verifier: a format term (a regular expression the completion
must match) and a length term (a penalty per character beyond a budget). Off by default."""

from __future__ import annotations

import re
from typing import Iterator

from pydantic import BaseModel, ConfigDict, Field, field_validator

from prime.rl.environments.base import Environment, Split, Task


class RewardTerms(BaseModel):
    """reward = (1 - format_weight) * task + format_weight * [format matches] - length penalty, in [0, 1]."""

    model_config = ConfigDict(extra="forbid")

    format_regex: str | None = Field(None, description="A completion that matches (re.search) earns the format term.")
    format_weight: float = Field(0.0, ge=0, le=1, description="Share of the reward that is the format term.")
    max_chars: int | None = Field(None, gt=0, description="Completions longer than this are penalised.")
    length_penalty: float = Field(0.0, ge=0, description="Reward lost per character beyond max_chars.")

    @field_validator("format_regex")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as e:
                raise ValueError(f"format_regex does not compile: {e}") from None
        return value

    @property
    def active(self) -> bool:
        return (self.format_regex is not None and self.format_weight > 0) or (
            self.max_chars is not None and self.length_penalty > 0)


class WithTerms:
    """An environment whose reward also carries the terms; tasks and name are the inner one's."""

    def __init__(self, inner: Environment, terms: RewardTerms) -> None:
        self.inner, self.terms, self.name = inner, terms, inner.name
        self._format = re.compile(terms.format_regex) if terms.format_regex else None

    def tasks(self, split: Split, seed: int) -> Iterator[Task]:
        return self.inner.tasks(split, seed)

    def reward(self, task: Task, completion: str) -> float:
        t = self.terms
        reward = self.inner.reward(task, completion)
        if self._format is not None and t.format_weight > 0:
            reward = (1 - t.format_weight) * reward + t.format_weight * float(bool(self._format.search(completion)))
        if t.max_chars is not None and t.length_penalty > 0:
            reward -= t.length_penalty * max(0, len(completion) - t.max_chars)
        return min(1.0, max(0.0, reward))
