"""Runs prime.rl's policy step (sharded_update: FSDP2 over however many ranks torchrun gives it) on fixed
rows, then writes the full weights: what test_parity.py compares between one process and two ranks.

    torchrun --nproc-per-node=N tests/e2e/rl_sharded_update.py POLICY_DIR OUT.pt MAX_GRAD_NORM
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)

from prime.core.distributed import close_local_group, init_local_group
from prime.core.optim import OptimConfig, build_optimizer
from prime.core.parallelize import parallelize
from prime.inference.hf_engine import load_hf_policy
from prime.rl.grpo import GRPOConfig
from prime.rl.update import Row, sharded_update


def rows(vocab: int) -> list[Row]:
    """The same 12 completions for any layout: prompts and completions of different lengths, advantages
    of both signs, logprobs near the policy's (so some ratios clip and some do not)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(12):
        prompt = torch.randint(1, vocab, (3 + i % 4,), generator=g).tolist()
        tokens = torch.randint(1, vocab, (2 + i % 5,), generator=g).tolist()
        logprobs = (-torch.rand(len(tokens), generator=g) * 3 - 0.5).tolist()
        out.append(Row(prompt, tokens, logprobs, float(torch.randn((), generator=g))))
    return out


def main() -> None:
    policy, out, clip = sys.argv[1], sys.argv[2], float(sys.argv[3])
    group = init_local_group("cpu")
    model = load_hf_policy(policy)
    model = parallelize(model, group.device, group.world_size, torch.float32, activation_checkpointing=False)
    # SGD: a gradient scaled wrongly moves the weights by as much more (AdamW would divide it away).
    optimizer, _ = build_optimizer(model, OptimConfig(name="sgd", lr=0.5, warmup_steps=0, schedule="constant"), 10)
    for _ in range(2):
        sharded_update(model, optimizer, rows(model.config.vocab_size), GRPOConfig(entropy_coef=0.05), 1.0, 0,
                       group.rank, group.world_size, epochs=2, max_grad_norm=clip)
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if group.rank == 0:
        torch.save(weights, out)
    # Both ranks leave Gloo together: a rank tearing its group down while rank 0 still wrote once died at
    # exit with "terminate called without an active exception" (1 run in ~5 of the suite).
    torch.distributed.barrier()
    close_local_group()


if __name__ == "__main__":
    main()
