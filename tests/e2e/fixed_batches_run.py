"""Trains the real Trainer (FSDP2 over however many ranks torchrun gives it) on fixed global batches, then
writes the full final weights: what test_parity.py compares between 1 rank with gradient accumulation
and several data-parallel ranks. The data is replaced because the property is about the arithmetic
(loss and gradient scaling across ranks and micro-batches, clipping of sharded gradients, the schedule),
and it needs every layout to train on exactly the same rows.

    torchrun --nproc-per-node=N tests/e2e/fixed_batches_run.py OUT.pt train.batch_size 8 ...
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)

from prime.config import load_config
from prime.core.distributed import close_local_group, init_local_group
from prime.pretrain.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]


def global_batches(batch: int, seq_len: int, vocab: int):
    """Step s's batch rows, the same for any layout: (batch, seq_len + 1) token ids."""
    step = 0
    while True:
        yield torch.randint(0, vocab, (batch, seq_len + 1), generator=torch.Generator().manual_seed(1000 + step))
        step += 1


def this_ranks_micro_batches(config, rank: int, world: int):
    """Rank r's rows of each global batch (a contiguous slice), cut into micro-batches in order."""
    per_rank = config.train.batch_size // world
    for rows in global_batches(config.train.batch_size, config.train.seq_len, 259):
        mine = rows[rank * per_rank:(rank + 1) * per_rank]
        for start in range(0, per_rank, config.train.micro_batch_size):
            micro = mine[start:start + config.train.micro_batch_size]
            yield micro[:, :-1], micro[:, 1:]


def main() -> int:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    config = load_config(REPO / "configs/debug.toml", dict(zip(overrides[::2], overrides[1::2])))
    group = init_local_group("cpu")
    trainer = Trainer(config, group, Path(out).parent / f"run-{group.world_size}", quiet=True)
    trainer._batches = this_ranks_micro_batches(config, group.rank, group.world_size)
    try:
        for _ in range(config.train.max_steps):
            trainer.train_step()
        weights = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if group.rank == 0:
            torch.save(weights, out)
        if dist.is_initialized():
            dist.barrier()
    finally:
        trainer.close()
        close_local_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
