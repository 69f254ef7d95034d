"""Held-out evaluation of a policy on an environment: the same measure for the orchestrator (each
chosen version) and the reference loop."""

from __future__ import annotations

from prime.inference.engine import GenerationRequest, InferenceEngine
from prime.inference.sampling import SamplingParams
from prime.rl.environments.base import Environment, Task


def decode(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


def evaluate(engine: InferenceEngine, env: Environment, tokenizer, tasks: list[Task], max_tokens: int) -> float:
    """Mean reward of greedy completions on held-out tasks."""
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    requests = [GenerationRequest(tokenizer.encode(t.prompt, add_special_tokens=False), 0, sampling) for t in tasks]
    completions = engine.generate(requests)
    return sum(env.reward(t, decode(tokenizer, c.tokens)) for t, c in zip(tasks, completions)) / len(tasks)
