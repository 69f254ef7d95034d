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


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def adam_state_tensors(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's AdamW moments (its local shards, flat fp32, in `params` order) and step count: what a
    node that takes another's place needs so its first inner steps are not taken with empty moments."""
    avg, sq, step = [], [], 0.0
    for p in params:
        state = optimizer.state.get(p, {})
        size = _local(p).numel()
        avg.append(_local(state["exp_avg"]).detach().reshape(-1).float().cpu() if "exp_avg" in state else
                   torch.zeros(size))
        sq.append(_local(state["exp_avg_sq"]).detach().reshape(-1).float().cpu() if "exp_avg_sq" in state else
                  torch.zeros(size))
        if "step" in state:
            step = float(state["step"])
    flat = lambda parts: torch.cat(parts) if parts else torch.zeros(0)  # noqa: E731
    return {"exp_avg": flat(avg), "exp_avg_sq": flat(sq), "step": torch.tensor([step])}


def bound_first_moment(tensors: dict[str, torch.Tensor], betas: tuple[float, float]) -> int:
    """Makes moments whose first and second halves may come from different peers safe to step with: clamps
    |exp_avg| to the largest value one gradient history could give with this exp_avg_sq. Returns how
    many values it changed.

    A joiner takes each chunk of the moments from any peer, so an element's exp_avg and exp_avg_sq can
    come from two histories. Where one peer saw a rare token's embedding row and the other never did,
    exp_avg is set and exp_avg_sq is 0, and AdamW's first step moves that value by lr × exp_avg / eps:
    seen here as a pseudo-gradient 400× the others' median, refused by every peer. One history obeys,
    by Cauchy-Schwarz over m = (1−β1) Σ β1^k g_k and v = (1−β2) Σ β2^k g_k²,
    m² ≤ (1−β1)²/(1−β2) · Σ_{k<t} (β1²/β2)^k · v, so the clamp never touches moments of one peer."""
    beta1, beta2 = betas
    steps = max(1.0, float(tensors["step"][0]))
    ratio = beta1 * beta1 / beta2
    series = steps if abs(ratio - 1.0) < 1e-12 else (1.0 - ratio ** steps) / (1.0 - ratio)
    # 1e-3 of slack: float rounding of a history that sits on the bound must not count as a disagreement.
    limit = tensors["exp_avg_sq"].sqrt() * ((1.0 - beta1) * math.sqrt(series / (1.0 - beta2)) * 1.001)
    avg = tensors["exp_avg"]
    over = avg.abs() > limit
    changed = int(over.sum())
    if changed:
        avg.copy_(torch.where(over, avg.sign() * limit, avg))
    return changed


def load_adam_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """The inverse of adam_state_tensors, into an optimizer over the same (same-sharded) parameters."""
    sizes = [_local(p).numel() for p in params]
    if tensors["exp_avg"].numel() != sum(sizes) or tensors["exp_avg_sq"].numel() != sum(sizes):
        raise ValueError(f"AdamW state of {tensors['exp_avg'].numel()} values does not fit this rank's "
                         f"{sum(sizes)} parameters (different model or sharding)")
    step = float(tensors["step"][0])
    for p, avg, sq in zip(params, tensors["exp_avg"].split(sizes), tensors["exp_avg_sq"].split(sizes)):
        local = _local(p)
        state = optimizer.state[p]
        moments = [m.view_as(local).to(device=local.device, dtype=local.dtype) for m in (avg, sq)]
        if hasattr(p, "to_local"):  # an FSDP2 shard: the moments are DTensors laid out like the parameter
            from torch.distributed.tensor import DTensor

            moments = [DTensor.from_local(m, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                       for m in moments]
        state["exp_avg"], state["exp_avg_sq"] = moments
        if isinstance(state.get("step"), torch.Tensor):
            state["step"].fill_(step)
        else:
            state["step"] = torch.tensor(step, dtype=torch.float32)  # AdamW's own (non-capturable) step type
