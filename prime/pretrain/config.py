"""Settings of the inner training loop itself (batching, steps, eval, precision)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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
