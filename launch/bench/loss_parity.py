"""Benchmark: final eval loss of DiLoCo (N nodes, int8) against data-parallel training at equal tokens.

DiLoCo: N nodes of one rank each (a local cluster), node i reading data slot i of N. Data-parallel:
one node of N ranks (FSDP2) with N× the batch, so both see the same sequences per step and the same
tokens in all. Both final checkpoints are then evaluated by this script on the same held-out
sequences. Targets: ratio ≤ 1.01 with 2 nodes, ≤ 1.02 with 4.

    python launch/bench/loss_parity.py [--nodes 2] [--steps 150] [--inner-steps 50]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]

from launch.cluster import LocalCluster, child_env
from prime.config import load_config
from prime.core.checkpoint import CheckpointStore
from prime.core.model import build_model
from prime.data.builtin_corpus import prepare
from prime.data.loader import (
    BatchIterator,
    DataConfig,
    PackedSequenceStream,
    eval_shards,
    train_and_eval_files,
)
from prime.data.tokenizer import ByteTokenizer


@torch.no_grad()
def eval_loss(config, checkpoint: Path, corpus: Path, batches: int = 16) -> float:
    model = build_model(config.model, 0)
    CheckpointStore.load_model(checkpoint, model)
    model.eval()
    _, eval_files = train_and_eval_files(DataConfig(path=str(corpus)))
    stream = PackedSequenceStream(eval_shards(eval_files, 0, 1), ByteTokenizer(), config.train.seq_len)
    it, total = BatchIterator(stream, 8), 0.0
    for _ in range(batches):
        inputs, labels = next(it)
        total += F.cross_entropy(model(input_ids=inputs).logits.flatten(0, 1), labels.flatten()).item()
    return total / batches


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="example: python launch/bench/loss_parity.py --nodes 2 --steps 150")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--config", default="configs/cpu-demo.toml")
    parser.add_argument("--outer-lr", type=float, default=None, help="diloco.outer_lr (default: the config's)")
    parser.add_argument("--outer-momentum", type=float, default=None,
                        help="diloco.outer_momentum (default: the config's)")
    parser.add_argument("--mode", default="blocking", help="diloco.mode of the DiLoCo run")
    args = parser.parse_args()
    corpus = prepare()
    config = load_config(REPO / args.config)
    common = ["--data.path", str(corpus), "--train.max_steps", str(args.steps), "--train.eval_every", "0",
              "--checkpoint.every", "0", "--quiet"]
    final = f"step_{args.steps:08d}"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        diloco = common + ["--diloco.inner_steps", str(args.inner_steps), "--diloco.mode", args.mode]
        for key, value in (("outer_lr", args.outer_lr), ("outer_momentum", args.outer_momentum)):
            if value is not None:
                diloco += [f"--diloco.{key}", str(value)]
        with LocalCluster(tmp / "diloco", args.config, diloco, coordinator_args=["--min-wait-s", "60"]) as c:
            c.run_nodes([f"node{i}" for i in range(args.nodes)], 7200)
        batch = config.train.batch_size * args.nodes
        dp = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc-per-node={args.nodes}",
              "-m", "prime.train", "--config", args.config, "--run-dir", str(tmp / "dp"),
              "--train.batch_size", str(batch), *common]
        subprocess.run(dp, cwd=REPO, env=child_env(), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        diloco_loss = eval_loss(config, tmp / "diloco" / "node0" / "checkpoints" / final, corpus)
        dp_loss = eval_loss(config, tmp / "dp" / "checkpoints" / final, corpus)
    tokens = args.steps * config.train.batch_size * config.train.seq_len * args.nodes
    outer = config.diloco
    lr = args.outer_lr if args.outer_lr is not None else outer.outer_lr
    momentum = args.outer_momentum if args.outer_momentum is not None else outer.outer_momentum
    print(f"{args.config}, {args.nodes} nodes, H={args.inner_steps}, {args.steps} steps, {tokens / 1e6:.2f}M tokens "
          f"each way; DiLoCo {args.mode}, outer lr {lr:g}, momentum {momentum:g}")
    print(f"eval loss: DiLoCo (int8) {diloco_loss:.4f}, data-parallel {dp_loss:.4f}, ratio {diloco_loss / dp_loss:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
