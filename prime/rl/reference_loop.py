"""The reference loop: GRPO in one process, synchronously (async level 0): generate G completions per
prompt with the seeded engine, score them with the environment's verifier, normalise within groups, take
one step.

The distributed roles (orchestrator, trainer, inference workers) are built from the same pieces; this
loop is the reference they are measured against and a way to debug a task on one machine. With
`staleness` k it generates with the policy of k updates ago, as an async-k run does once its pipeline
is full: how much the learning itself loses to stale rollouts, apart from any pipeline
(launch/bench/rl_staleness.py).
"""

from __future__ import annotations

import copy
import random
import time
from collections import deque
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field

from prime.inference.engine import GenerationRequest
from prime.inference.hf_engine import HFEngine
from prime.inference.sampling import SamplingParams
from prime.rl.environments.base import Environment, Task
from prime.rl.environments.evaluation import decode, evaluate
from prime.rl.grpo import ENTROPY_BONUS, GRPOConfig, group_advantages
from prime.rl.update import Row, policy_update


class LoopConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(300, gt=0)
    prompts_per_step: int = Field(32, gt=0)
    lr: float = Field(3e-4, gt=0, description="AdamW learning rate (1e-3 collapsed the digit policy's entropy "
                      "before it learned to copy: held-out reward stuck near 0.5).")
    epochs: int = Field(2, ge=1, description="Optimizer steps on each batch (the ratio clipping acts from the second).")
    temperature: float = Field(1.0, gt=0)
    max_tokens: int = Field(5, gt=0, description="Completion limit; the reverse task needs max_digits + 1 (EOS).")
    eval_every: int = Field(20, gt=0)
    staleness: int = Field(0, ge=0, le=16, description="Generate with the policy of this many updates ago (0: "
                           "on-policy; an async-k run's rollouts are k versions old once its pipeline is full).")
    stop_at_reward: float | None = Field(None, gt=0, le=1, description="End at the first evaluation reaching it.")
    seed: int = 0
    grpo: GRPOConfig = GRPOConfig(entropy_coef=ENTROPY_BONUS)


@dataclass
class Scored:
    task: Task
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    reward: float


def generate_scored(engine: HFEngine, env: Environment, tokenizer, tasks: list[Task], group: int,
                    sampling: SamplingParams, rng: random.Random) -> list[list[Scored]]:
    """G completions per task, each with its own seed, scored by the environment."""
    requests = [GenerationRequest(tokenizer.encode(t.prompt, add_special_tokens=False), rng.getrandbits(63), sampling)
                for t in tasks for _ in range(group)]
    completions = engine.generate(requests)
    scored = [Scored(tasks[i // group], r.prompt, c.tokens, c.logprobs, env.reward(tasks[i // group], decode(tokenizer, c.tokens)))
              for i, (r, c) in enumerate(zip(requests, completions))]
    return [scored[i:i + group] for i in range(0, len(scored), group)]


def rows_of(groups: list[list[Scored]], config: GRPOConfig) -> tuple[list[Row], dict[str, float]]:
    """The completions of the groups that carry signal, with their group-normalised advantages."""
    rewards = torch.tensor([[s.reward for s in g] for g in groups])
    advantages, keep = group_advantages(rewards, config)
    rows = [Row(s.prompt, s.tokens, s.logprobs, float(a))
            for g, adv, k in zip(groups, advantages, keep) if k for s, a in zip(g, adv)]
    return rows, {"reward_mean": float(rewards.mean()), "groups_kept": float(keep.float().mean())}


def run(model, tokenizer, env: Environment, config: LoopConfig, log=print) -> list[dict]:
    """The synchronous loop; returns one record per step (eval reward where evaluated)."""
    rng = random.Random(config.seed)
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id)
    # The generating policy: the model itself, or a copy holding the weights of `staleness` updates ago.
    behaviour = copy.deepcopy(model) if config.staleness else model
    sampler = HFEngine(behaviour, pad_id=tokenizer.pad_token_id) if config.staleness else engine
    history = deque([copy.deepcopy(model.state_dict())], maxlen=config.staleness + 1) if config.staleness else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    train = env.tasks("train", config.seed)
    held_out = list(env.tasks("eval", config.seed))
    sampling = SamplingParams(temperature=config.temperature, max_tokens=config.max_tokens)
    records, started = [], time.perf_counter()
    for step in range(config.steps + 1):
        record = {"step": step, "time_s": round(time.perf_counter() - started, 2)}
        if step % config.eval_every == 0 or step == config.steps:
            record["eval_reward"] = evaluate(engine, env, tokenizer, held_out, config.max_tokens)
            log(f"step {step}: held-out reward {record['eval_reward']:.3f} at {record['time_s']} s")
            if config.stop_at_reward is not None and record["eval_reward"] >= config.stop_at_reward:
                records.append(record)
                break
        if step < config.steps:
            if config.staleness:
                behaviour.load_state_dict(history[0])  # the oldest kept: `staleness` updates ago (fewer at first)
            groups = generate_scored(sampler, env, tokenizer, [next(train) for _ in range(config.prompts_per_step)],
                                     config.grpo.group_size, sampling, rng)
            rows, stats = rows_of(groups, config.grpo)
            record |= stats | policy_update(model, optimizer, rows, config.grpo, config.temperature,
                                            tokenizer.pad_token_id, config.epochs)
            if config.staleness:
                history.append(copy.deepcopy(model.state_dict()))
        records.append(record)
    return records
