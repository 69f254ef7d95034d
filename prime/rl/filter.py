"""Offline difficulty filter: scores tasks by the policy's pass rate, as INTELLECT-2 filtered its data
with the base model before training, so that RL spends no rollouts on what the policy always or never
solves.

    python -m prime.rl.filter --policy DIR --tasks 512 --samples 8 --out scored.jsonl [--min-pass 0.05 --max-pass 0.95]
                              [--env.name math --env.path problems.jsonl]

Writes one line per task: {id, prompt, answer, pass_rate, mean_reward, kept}. With a math environment,
--keep-out writes the kept problems as a NuminaMath-style jsonl that `env.path` can point at.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from elastic_mesh import CommandLine, Flag
from prime.inference.engine import GenerationRequest
from prime.inference.hf_engine import HFEngine, load_hf_policy
from prime.inference.sampling import SamplingParams
from prime.rl.environments import build_environment
from prime.rl.environments.math_answers import MathConfig
from prime.rl.orchestrator.config import OrchestratorConfig


def pass_rates(engine: HFEngine, tokenizer, env, tasks, samples: int, sampling: SamplingParams, solved_at: float,
               seed: int, batch_prompts: int = 16) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for start in tqdm(range(0, len(tasks), batch_prompts), desc="scoring", unit="batch"):
        chunk = tasks[start:start + batch_prompts]
        requests = [GenerationRequest(tokenizer.encode(t.prompt, add_special_tokens=False), rng.getrandbits(63), sampling)
                    for t in chunk for _ in range(samples)]
        completions = engine.generate(requests)
        for i, task in enumerate(chunk):
            rewards = [env.reward(task, tokenizer.decode(c.tokens, skip_special_tokens=True))
                       for c in completions[i * samples:(i + 1) * samples]]
            rows.append({"id": task.id, "prompt": task.prompt, "answer": task.answer,
                         "pass_rate": sum(r >= solved_at for r in rewards) / samples,
                         "mean_reward": sum(rewards) / samples})
    return rows


COMMAND_LINE = CommandLine(
    "python -m prime.rl.filter",
    "Offline difficulty filter: scores tasks by the policy's pass rate, so that RL spends no rollouts on what\n"
    "the policy always or never solves. The task, sampling and seed are an OrchestratorConfig's.",
    OrchestratorConfig,
    [Flag("policy", "a local HF causal-LM directory", required=True, type=Path, metavar="DIR"),
     Flag("tasks", "train tasks to score", type=int, default=512, metavar="N"),
     Flag("samples", "samples per task", type=int, default=8, metavar="N"),
     Flag("min-pass", "keep tasks whose pass rate is above this (0: drop tasks never solved)", type=float,
          default=0.0, metavar="RATE"),
     Flag("max-pass", "keep tasks whose pass rate is below this (1: drop tasks always solved)", type=float,
          default=1.0, metavar="RATE"),
     Flag("out", "jsonl of every scored task", required=True, type=Path, metavar="FILE"),
     Flag("keep-out", "math environment: the kept problems as NuminaMath jsonl", type=Path, metavar="FILE"),
     Flag("threads", "torch threads", type=int, default=1, metavar="N")],
    examples=["python -m prime.rl.filter --policy DIR --tasks 512 --samples 8 --out scored.jsonl "
              "--env.name math --env.path problems.jsonl"],
)


def main(argv: list[str] | None = None) -> int:
    parsed = COMMAND_LINE.parse(argv)
    config, args = parsed.config, SimpleNamespace(**parsed.flags)
    torch.set_num_threads(args.threads)
    env = build_environment(config.env, config.reward_terms)
    tokenizer = AutoTokenizer.from_pretrained(args.policy)
    engine = HFEngine(load_hf_policy(args.policy), pad_id=tokenizer.pad_token_id or 0)
    stream = env.tasks("train", config.seed)
    tasks = [next(stream) for _ in range(args.tasks)]
    sampling = SamplingParams(temperature=config.temperature, top_p=config.top_p, max_tokens=config.max_tokens)
    rows = pass_rates(engine, tokenizer, env, tasks, args.samples, sampling, config.filter.solved_at, config.seed)
    kept = 0
    with args.out.open("w") as out:
        for row in rows:
            row["kept"] = args.min_pass < row["pass_rate"] < args.max_pass
            kept += row["kept"]
            out.write(json.dumps(row) + "\n")
    if args.keep_out:
        if not isinstance(config.env, MathConfig):
            raise SystemExit("--keep-out writes math problems; the environment here generates its tasks")
        suffix = config.env.prompt_suffix
        with args.keep_out.open("w") as out:
            for row in rows:
                if row["kept"]:
                    problem = row["prompt"][:-len(suffix)] if suffix and row["prompt"].endswith(suffix) else row["prompt"]
                    out.write(json.dumps({"problem": problem, "solution": "", "answer": row["answer"],
                                          "pass_rate": row["pass_rate"]}) + "\n")
    rates = [r["pass_rate"] for r in rows]
    print(f"filter: {len(rows)} tasks, mean pass rate {sum(rates) / len(rates):.3f}; never solved "
          f"{sum(r == 0 for r in rates)}, always solved {sum(r == 1 for r in rates)}; kept {kept} "
          f"({args.min_pass} < pass rate < {args.max_pass}) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
