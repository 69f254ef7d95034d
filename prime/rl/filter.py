"""Offline difficulty filter: scores tasks by the policy's pass rate, as INTELLECT-2 filtered its data
with the base model before training, so that RL spends no rollouts on what the policy always or never
solves.

    python -m prime.rl.filter --policy DIR --tasks 512 --samples 8 --out scored.jsonl [--min-pass 0.05 --max-pass 0.95]
                              [--set env.name=math --set env.path=problems.jsonl]

Writes one line per task: {id, prompt, answer, pass_rate, mean_reward, kept}. With a math environment,
--keep-out writes the kept problems as a NuminaMath-style jsonl that `env.path` can point at.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from prime.inference.engine import GenerationRequest
from prime.inference.hf_engine import HFEngine, load_hf_policy
from prime.inference.sampling import SamplingParams
from prime.rl.cli import load_config
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prime.rl.filter", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", type=Path, required=True, help="a local HF causal-LM directory")
    parser.add_argument("--tasks", type=int, default=512, help="train tasks to score (default 512)")
    parser.add_argument("--samples", type=int, default=8, help="samples per task (default 8)")
    parser.add_argument("--min-pass", type=float, default=0.0, help="keep tasks whose pass rate is above this "
                        "(default 0: drop tasks never solved)")
    parser.add_argument("--max-pass", type=float, default=1.0, help="keep tasks whose pass rate is below this "
                        "(default 1: drop tasks always solved)")
    parser.add_argument("--out", type=Path, required=True, help="jsonl of every scored task")
    parser.add_argument("--keep-out", type=Path, help="math environment: the kept problems as NuminaMath jsonl")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--config", type=Path, help="an OrchestratorConfig TOML (env, sampling, seed)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a config field")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = load_config(OrchestratorConfig, args.config, args.set)
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
