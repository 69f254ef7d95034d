"""Properties DiLoCo's quality rests on, each an exact equivalence (up to float rounding):

- data-parallel over N ranks is one rank with N× the batch by gradient accumulation (loss and gradient
  scaling, clipping of sharded gradients, the schedule);
- with outer lr 1, no momentum and the same data, M DiLoCo replicas are one node, for any H (the outer
  step, the inner optimizer state across rounds, the schedule across outer steps);
- the RL trainer's policy step over N data-parallel ranks (FSDP2) is the step of one process on the
  whole batch (its token-weighted loss scaling, clipping).

(DiLoCo with H = 1 and SGD equals data-parallel SGD: test_diloco.py.)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from launch.cluster import LocalCluster
from prime.config import load_config
from prime.core.checkpoint import CheckpointStore
from prime.core.model import build_model
from tests.conftest import REPO, TORCHRUN, child_env, run_train

RUN = str(REPO / "tests/e2e/fixed_batches_run.py")
RL_STEP = str(REPO / "tests/e2e/rl_sharded_update.py")


def _fixed_batches(tmp_path, name: str, ranks: int, batch: int, micro: int, clip: float) -> dict[str, torch.Tensor]:
    out = tmp_path / f"{name}.pt"
    # SGD: a gradient scaled wrongly moves the weights by as much more (AdamW would divide it away).
    flags = ["train.batch_size", str(batch), "train.micro_batch_size", str(micro), "train.max_steps", "6",
             "train.grad_clip", str(clip), "optim.name", "sgd", "optim.lr", "0.5", "optim.warmup_steps", "2",
             "checkpoint.every", "0"]
    cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={ranks}", RUN, str(out), *flags] if ranks > 1 else \
          [sys.executable, RUN, str(out), *flags]
    result = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out)


def _assert_same_weights(a: dict, b: dict, initial: dict) -> None:
    moved = 0.0
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=1e-5, atol=2e-6), f"{key}: max diff {(a[key] - b[key]).abs().max():.2e}"
        moved = max(moved, (a[key] - initial[key]).abs().max().item())
    assert moved > 1e-3, "the weights barely moved; the comparison would prove nothing"


def test_data_parallel_ranks_equal_one_rank_accumulating_their_batch(tmp_path):
    initial = build_model(load_config(REPO / "configs/debug.toml").model, 0).state_dict()
    # Clipping at 0.3 acts at every step here (gradient norms ~1–3), on sharded gradients with 2 ranks.
    one_rank = _fixed_batches(tmp_path, "one", ranks=1, batch=8, micro=4, clip=0.3)  # 2 micro-batches accumulated
    two_ranks = _fixed_batches(tmp_path, "two", ranks=2, batch=8, micro=4, clip=0.3)  # FSDP2, 4 rows per rank
    _assert_same_weights(two_ranks, one_rank, initial)
    # Unclipped, both at once: 2 ranks each accumulating 2 micro-batches against 1 rank accumulating 4.
    _assert_same_weights(_fixed_batches(tmp_path, "two-acc", ranks=2, batch=16, micro=4, clip=0),
                         _fixed_batches(tmp_path, "one-acc", ranks=1, batch=16, micro=4, clip=0), initial)


@pytest.fixture
def identical_shards(tmp_path, corpus):
    """A corpus whose shards all hold the same documents: whichever shard a node leases, it reads what
    every other node and the single node read (with data.interleave = 1)."""
    root = tmp_path / "same"
    root.mkdir()
    for k in range(4):
        shutil.copy(corpus / "train-00000.jsonl", root / f"train-{k:05d}.jsonl")
    shutil.copy(corpus / "eval-00000.jsonl", root / "eval-00000.jsonl")
    (root / "manifest.json").write_text(json.dumps({"note": "4 copies of one shard"}))
    return root


def test_replicas_on_the_same_data_with_a_plain_outer_step_are_one_node(tmp_path, identical_shards):
    common = ["--data.path", str(identical_shards), "--data.interleave", "1", "--train.max_steps", "10",
              "--train.eval_every", "0", "--checkpoint.every", "0"]
    # H = 5 (two outer steps over AdamW with a warm-up and cosine schedule), averaged without compression.
    diloco = common + ["--diloco.inner_steps", "5", "--diloco.outer_lr", "1.0", "--diloco.outer_momentum", "0",
                       "--diloco.compression", "none"]
    with LocalCluster(tmp_path / "diloco", "configs/debug.toml", diloco,
                      coordinator_args=["--lease-s", "5", "--min-wait-s", "5"]) as c:
        c.run_nodes(["node0", "node1"], 180)
    run_train(["--config", "configs/debug.toml", "--run-dir", str(tmp_path / "one"), *common])
    config = load_config(REPO / "configs/debug.toml")
    weights = {}
    for name, path in (("node0", tmp_path / "diloco" / "node0"), ("node1", tmp_path / "diloco" / "node1"),
                       ("one", tmp_path / "one")):
        model = build_model(config.model, 0)
        CheckpointStore.load_model(path / "checkpoints" / "step_00000010", model)
        weights[name] = model.state_dict()
    initial = build_model(config.model, 0).state_dict()
    _assert_same_weights(weights["node0"], weights["one"], initial)
    _assert_same_weights(weights["node1"], weights["one"], initial)

    # Resetting the inner AdamW at every outer step: the replicas still agree (the state is rebuilt alike
    # everywhere), and the second round starts from fresh moments, so the weights are no longer one node's.
    with LocalCluster(tmp_path / "reset", "configs/debug.toml", diloco + ["--diloco.inner_optimizer", "reset"],
                      coordinator_args=["--lease-s", "5", "--min-wait-s", "5"]) as c:
        c.run_nodes(["node0", "node1"], 180)
    reset = {}
    for name in ("node0", "node1"):
        model = build_model(config.model, 0)
        CheckpointStore.load_model(tmp_path / "reset" / name / "checkpoints" / "step_00000010", model)
        reset[name] = model.state_dict()
    _assert_same_weights(reset["node0"], reset["node1"], initial)
    moved = max((reset["node0"][k] - weights["one"][k]).abs().max().item() for k in initial)
    assert moved > 1e-4, f"inner_optimizer reset changed nothing (largest difference {moved:.2e})"


def test_the_rl_policy_step_over_two_ranks_is_the_step_of_one_process(tmp_path):
    from prime.inference.hf_engine import load_hf_policy
    from prime.rl.policy import new_digit_policy

    policy = new_digit_policy(tmp_path / "policy", seed=0)
    initial = load_hf_policy(policy).state_dict()

    def step(ranks: int, clip: float) -> dict[str, torch.Tensor]:
        out = tmp_path / f"rl-{ranks}-{clip}.pt"
        cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={ranks}", RL_STEP] if ranks > 1 else [sys.executable, RL_STEP]
        result = subprocess.run([*cmd, str(policy), str(out), str(clip)], cwd=REPO, env=child_env(),
                                capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stderr[-4000:]
        return torch.load(out)

    # Rows of different lengths split unevenly in tokens: a rank's share must weigh by its tokens.
    _assert_same_weights(step(2, 1e9), step(1, 1e9), initial)  # SGD unclipped: any scaling error shows
    _assert_same_weights(step(2, 0.05), step(1, 0.05), initial)  # clipping on sharded gradients
