"""GPU smoke test: the CUDA path end to end on one GPU in under 5 minutes.

Runs `prime.train` under torchrun (NCCL local group), with FSDP2 applied even to the single rank,
bf16 compute, activation checkpointing, on the built-in corpus; then prints tokens/s and MFU from the
run's metrics.jsonl. Cannot run without a GPU.

    python launch/gpu_smoke.py [--steps 300] [--run-dir runs/gpu-smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# ~60M parameters: big enough to load the GPU, small enough for a few hundred steps in minutes.
OVERRIDES = {
    "name": "gpu-smoke", "model.hidden_size": "768", "model.intermediate_size": "2048", "model.num_layers": "8",
    "model.num_heads": "12", "model.num_kv_heads": "4", "model.max_position_embeddings": "1024",
    "train.seq_len": "1024", "train.batch_size": "32", "train.micro_batch_size": "16", "train.device": "cuda",
    "train.precision": "bf16", "train.shard_single_rank": "true", "train.activation_checkpointing": "true",
    "train.eval_every": "100", "checkpoint.every": "0", "optim.lr": "1e-3", "optim.warmup_steps": "30",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="example: python launch/gpu_smoke.py --steps 300")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--run-dir", type=Path, default=REPO / "runs" / "gpu-smoke")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device visible; run it on a GPU machine", file=sys.stderr)
        return 2
    overrides = [x for k, v in {**OVERRIDES, "train.max_steps": str(args.steps)}.items() for x in (f"--{k}", v)]
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "1", "-m", "prime.train",
           "--config", "configs/cpu-demo.toml", "--run-dir", str(args.run_dir), "--quiet", *overrides]
    env = {**os.environ, "PRIME_PLAIN_LOGS": "1"}
    result = subprocess.run(cmd, cwd=REPO, env=env)
    if result.returncode:
        return result.returncode
    records = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r][10:]  # skip warm-up
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    print(f"gpu_smoke on {torch.cuda.get_device_name(0)}: {len(steps) + 10} steps, "
          f"median {statistics.median(r['tokens_per_s'] for r in steps):.0f} tokens/s, "
          f"MFU {statistics.median(r['mfu'] for r in steps if r['mfu'] is not None):.3f}, "
          f"loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}, eval {evals[0]:.3f} -> {evals[-1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
