"""What a pretraining run of one node is configured by: the inner loop itself (batching, steps, eval,
precision: TrainConfig) and the sections it is built from (model, data, optimizer, checkpoints,
metrics: PretrainConfig). A multi-node job adds its own sections on top (prime/config.py)."""

from __future__ import annotations

import glob
import hashlib
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from elastic_mesh import ConfigError
from prime.core.checkpoint import CheckpointConfig
from prime.core.metrics import MetricsConfig
from prime.core.model import ModelConfig
from prime.core.optim import OptimConfig
from prime.data.loader import DataConfig


class TrainConfig(BaseModel):
    """The inner loop: how much data per step, for how long, and how often to evaluate."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(0, description="Seeds the model init; every rank and node builds the same weights.")
    seq_len: int = Field(256, gt=1, description="Tokens per training sequence.")
    batch_size: int = Field(16, gt=0, description="Sequences per optimizer step on one node (all local ranks).")
    micro_batch_size: int = Field(8, gt=0, description="Sequences per forward pass on one rank.")
    max_steps: int = Field(300, gt=0, description="Inner optimizer steps of the run.")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this (0: off).")
    z_loss: float = Field(0.0, ge=0, description="Weight of the z-loss (log-partition squared) term; 0: off.")
    activation_checkpointing: bool = Field(False, description="Recompute each block's activations in backward.")
    eval_every: int = Field(50, ge=0, description="Steps between eval-loss measurements (0: only at the end).")
    eval_batches: int = Field(4, gt=0, description="Micro-batches per rank in each eval.")
    log_every: int = Field(10, gt=0, description="Steps between log lines when not on a terminal.")
    shard_single_rank: bool = Field(
        False, description="Apply FSDP2 even with one local rank (exercises the sharded path on a single GPU)."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available, else cpu.")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="Compute dtype: auto is bf16 on CUDA (fp32 reductions, fp32 master weights), fp32 on CPU."
    )
    peak_tflops: float | None = Field(
        None, gt=0, description="Per-device peak TFLOP/s for the MFU estimate; None: known GPUs, or measured on CPU."
    )


class PretrainConfig(BaseModel):
    """Everything the pretraining Trainer reads: one node's model, data and inner loop."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("prime", description="Name of the run (used for the run directory and wandb).")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @model_validator(mode="after")
    def _check_across_sections(self) -> "PretrainConfig":
        if self.train.seq_len > self.model.max_position_embeddings:
            raise ValueError(
                f"train.seq_len {self.train.seq_len} exceeds model.max_position_embeddings "
                f"{self.model.max_position_embeddings}; lower train.seq_len or raise the model's positions"
            )
        if self.data.source == "files" and not self.data.path:
            raise ValueError("data.source = 'files' needs data.path (a file, directory or glob of jsonl/parquet/txt)")
        if self.data.source == "hub" and not self.data.hub_name:
            raise ValueError("data.source = 'hub' needs data.hub_name, e.g. 'HuggingFaceFW/fineweb-edu'")
        for name, value in (("data.path", self.data.path), ("data.eval_path", self.data.eval_path)):
            if self.data.source == "files" and value and not _exists(value):
                raise ValueError(f"{name} {value!r} does not exist; point it at a file, directory or glob of data")
        return self

    def check_world(self, local_world_size: int) -> None:
        """Checks that depend on how many processes this node runs."""
        per_step = self.train.micro_batch_size * local_world_size
        if self.train.batch_size % per_step:
            raise ConfigError(
                f"train.batch_size {self.train.batch_size} is not divisible by train.micro_batch_size "
                f"{self.train.micro_batch_size} × {local_world_size} local ranks; choose a multiple of {per_step}"
            )

    def check_tokenizer(self, vocab_size: int, eos_id: int) -> None:
        if vocab_size > self.model.vocab_size or eos_id >= self.model.vocab_size:
            raise ConfigError(
                f"the tokenizer has {vocab_size} tokens but model.vocab_size is {self.model.vocab_size}; "
                f"set model.vocab_size to at least {vocab_size}"
            )

    def grad_accumulation_steps(self, local_world_size: int) -> int:
        return self.train.batch_size // (self.train.micro_batch_size * local_world_size)

    def model_fingerprint(self) -> str:
        """Identifies what must match for nodes to train the same model together."""
        blob = json.dumps({"model": self.model.model_dump(), "seq_len": self.train.seq_len,
                           "tokenizer": self.data.tokenizer, "seed": self.train.seed}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _exists(pattern: str) -> bool:
    return Path(pattern).expanduser().exists() or bool(glob.glob(str(Path(pattern).expanduser())))
