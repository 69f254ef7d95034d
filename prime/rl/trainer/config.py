"""The RL trainer's settings: how it steps the policy on each batch, how long it trains, how often it
checkpoints, and the precision each published version travels in."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from prime.core.optim import OptimConfig
from prime.rl.grpo import ENTROPY_BONUS, GRPOConfig


class RLTrainerConfig(BaseModel):
    """How the trainer steps the policy on each batch, and how long it trains."""

    model_config = ConfigDict(extra="forbid")

    max_steps: int = Field(600, gt=0, description="Steps after which the trainer ends the run (the orchestrator "
                           "may end it sooner: stop_at_reward).")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(
        lr=3e-4, betas=(0.9, 0.999), weight_decay=0.0, warmup_steps=0, schedule="constant"),
        description="AdamW; constant 3e-4 by default (1e-3 collapsed the digit policy's entropy early).")
    epochs: int = Field(2, ge=1, le=16, description="Optimizer steps per batch (ratio clipping acts from the second).")
    max_grad_norm: float = Field(1.0, gt=0)
    grpo: GRPOConfig = Field(default_factory=lambda: GRPOConfig(entropy_coef=ENTROPY_BONUS),
                             description="Clipping (epsilon, delta), the KL weight, the entropy bonus.")
    checkpoint_every: int = Field(5, ge=1, le=63, description="Steps between checkpoints (and after the last). A "
                                  "restarted trainer trains again at most this many steps minus one, on the same "
                                  "batches (the orchestrator keeps them). A checkpoint at every step cost the async-2 "
                                  "trainer 0.1 s of its 0.5 s step on 2 cores (docs/benchmarks.md, RL).")
    checkpoint_keep: int = Field(2, ge=1, description="Checkpoints kept in RUN_DIR/checkpoints.")
    publish_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="The precision each policy version travels in. float32: versions bit-identical to "
        "the trainer's weights. bfloat16 halves the bytes every version moves to every worker; workers and the "
        "verifier compute in float32 on the rounded weights while the trainer keeps float32. Measured on the "
        "digit policy (docs/benchmarks.md, RL): over the emulated WAN async-2 trainer idle 48% -> 31%, but "
        "1.2-1.6x as many versions to reach held-out 0.9, so no sooner there.")
