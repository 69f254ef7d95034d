"""The prompts the orchestrator hands out: drawn in order from the environment's task stream (deterministic,
so a restarted orchestrator reads past what it drew before), numbered, tokenized with the policy's own
tokenizer, and those given back (a lease expired, came back stale or from an evicted worker) handed out
again first. A task whose prompt no honest worker could serve (empty, or too long for the model's context
with max_tokens) is refused here, with its reason in the log, rather than leased: its rollouts would fail
verification and cost an honest worker its place."""

from __future__ import annotations

import itertools
import logging
from collections import deque
from typing import Callable, Iterator

from elastic_mesh import Refused, printable
from prime.rl.environments.base import Task
from prime.rl.orchestrator.records import Prompt

log = logging.getLogger(__name__)

UNUSABLE_IN_A_ROW = 1000  # tasks refused one after another before the task data is declared broken


class PromptQueue:
    def __init__(self, tasks: Iterator[Task], tokenize: Callable[[str], list[int]],
                 context: Callable[[], int | None], max_tokens: int) -> None:
        """context: the policy's context length (None: unbounded), asked when a task is drawn."""
        self.tasks, self.tokenize, self.context, self.max_tokens = tasks, tokenize, context, max_tokens
        self.drawn = 0  # tasks read from the stream
        self.refused = 0  # tasks refused as unusable
        self.numbers = itertools.count()  # prompt numbers (and lease ids) never repeat within a start
        self.returned: deque[Prompt] = deque()

    def next(self) -> Prompt:
        if self.returned:
            return self.returned.popleft()
        for _ in range(UNUSABLE_IN_A_ROW):
            task = next(self.tasks)
            self.drawn += 1
            tokens = self.tokenize(task.prompt)
            why = self.unusable(tokens)
            if not why:
                return Prompt(next(self.numbers), task, tokens)
            self.refused += 1
            log.warning("task %s refused: %s", printable(task.id[:80]), why)
        raise Refused(503, f"the last {UNUSABLE_IN_A_ROW} tasks the environment gave were all refused (empty or "
                           "too long prompts, see the orchestrator's log); check the task data")

    def unusable(self, prompt: list[int]) -> str:
        """Why a prompt cannot be leased ('' if it can)."""
        if not prompt:
            return "an empty prompt"
        context = self.context()
        if context is not None and len(prompt) + self.max_tokens > context:
            return (f"its prompt of {len(prompt)} tokens and max_tokens {self.max_tokens} are more than the model's "
                    f"context of {context} tokens")
        return ""

    def give_back(self, prompts: list[Prompt]) -> None:
        """Prompts to hand out again before any new one (the earliest first)."""
        self.returned.extendleft(reversed(prompts))

    def resume(self, drawn: int, next_number: int) -> None:
        """Continues an earlier start's stream: reads past the `drawn` tasks it drew."""
        for _ in range(drawn):
            next(self.tasks)
        self.drawn, self.numbers = drawn, itertools.count(next_number)
