"""Benchmark: tokens/s of prime's inner step against a plain PyTorch loop of the same model and batch.

Both run in this one process, interleaved round by round (this machine is shared and noisy, so only
the ratio measured side by side means anything). Prime's step includes its streaming data pipeline
(tokenizing and packing on the fly); the plain loop gets ready-made tensors.

    python launch/bench/inner_step.py [--config configs/cpu-demo.toml] [--rounds 5] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from prime.config import load_config
from prime.core.distributed import close_local_group, init_local_group
from prime.core.model import build_model
from prime.pretrain.trainer import Trainer


def plain_loop(config, device, dtype, batches):
    model = build_model(config.model, config.train.seed, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.optim.lr, betas=config.optim.betas,
                                  weight_decay=config.optim.weight_decay, foreach=True)
    accumulation = config.train.batch_size // config.train.micro_batch_size

    def step(i):
        for m in range(accumulation):
            inputs, labels = batches[(i * accumulation + m) % len(batches)]
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                logits = model(input_ids=inputs).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
            (loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()  # the same host sync prime does to log its loss

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="example: python launch/bench/inner_step.py --rounds 5 --steps 10")
    parser.add_argument("--config", default="configs/cpu-demo.toml")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="steps per round and side")
    args = parser.parse_args()

    config = load_config(args.config, {"train.max_steps": str(10**6), "train.eval_every": "0",
                                       "checkpoint.every": "0", "metrics.progress": "false"})
    group = init_local_group(config.train.device)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(config, group, Path(run_dir), quiet=True)
        batches = [tuple(t.to(group.device) for t in next(trainer.batches)) for _ in range(16)]
        plain = plain_loop(config, group.device, trainer.dtype, batches)
        tokens = config.train.batch_size * config.train.seq_len
        sync = torch.cuda.synchronize if group.device.type == "cuda" else (lambda: None)
        for _ in range(3):  # warm-up both
            trainer.train_step(), plain(0)
        ratios, prime_tps, plain_tps = [], [], []
        for r in range(args.rounds):
            sync(); t0 = time.perf_counter()
            for _ in range(args.steps):
                trainer.train_step()
            sync(); t1 = time.perf_counter()
            for i in range(args.steps):
                plain(i)
            sync(); t2 = time.perf_counter()
            prime_tps.append(tokens * args.steps / (t1 - t0))
            plain_tps.append(tokens * args.steps / (t2 - t1))
            ratios.append(prime_tps[-1] / plain_tps[-1])
            print(f"round {r}: prime {prime_tps[-1]:.0f} tok/s, plain {plain_tps[-1]:.0f} tok/s, "
                  f"ratio {ratios[-1]:.3f}", flush=True)
        trainer.close()
    close_local_group()
    print(f"config {args.config} on {group.device} ({trainer.dtype}), {torch.get_num_threads()} threads")
    print(f"median: prime {statistics.median(prime_tps):.0f} tok/s, plain {statistics.median(plain_tps):.0f} tok/s, "
          f"ratio {statistics.median(ratios):.3f} (target >= 0.98)")


if __name__ == "__main__":
    main()
