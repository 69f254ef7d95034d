"""Inner optimizer (AdamW) and its learning-rate schedule."""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field


class OptimConfig(BaseModel):
    """The inner optimizer (AdamW) and its learning-rate schedule."""

    model_config = ConfigDict(extra="forbid")

    name: Literal["adamw", "sgd"] = Field("adamw", description="Inner optimizer (sgd: for exactness tests).")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW (beta1, beta2).")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(0.1, ge=0, description="Decoupled weight decay (not applied to norms).")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up from 0 to lr over this many steps.")
    schedule: Literal["cosine", "wsd", "wsd-sqrt", "constant"] = Field(
        "cosine", description="Shape after warm-up: cosine decay, or warmup-stable-decay with linear or 1-sqrt decay."
    )
    decay_fraction: float = Field(
        0.2, gt=0, le=1, description="WSD schedules: fraction of all steps spent in the final decay."
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate as a fraction of lr.")


def lr_factor(config: OptimConfig, step: int, total_steps: int) -> float:
    """Multiplier of the peak lr at `step` (0-based) of `total_steps`."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    floor = config.min_lr_ratio
    if config.schedule == "constant":
        return 1.0
    if config.schedule == "cosine":
        span = max(1, total_steps - config.warmup_steps)
        progress = min(1.0, (step - config.warmup_steps) / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_steps = max(1, int(round(config.decay_fraction * total_steps)))
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / decay_steps)
    shape = progress if config.schedule == "wsd" else math.sqrt(progress)
    return floor + (1 - floor) * (1 - shape)


def build_optimizer(
    model: torch.nn.Module, config: OptimConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    # Norm gains and biases are 1-D; decaying them toward zero only hurts.
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if config.name == "sgd":
        optimizer = torch.optim.SGD(groups, lr=config.lr)
    else:
        optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps, foreach=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(config, s, total_steps))
    return optimizer, scheduler
