"""What the DiLoCo hook and its catch-up may read and do on the trainer they are attached to.

The pretraining Trainer (prime/pretrain/trainer.py) satisfies it; anything else that runs inner steps
and offers these can carry DiLoCo. The hook changes the trainer only through the two methods here
(and the model's parameters, in place, at an outer step).
"""

from __future__ import annotations

from typing import Protocol

import torch

from prime.pretrain.config import PretrainConfig
from prime.core.metrics import MetricsWriter
from prime.core.progress import ProgressDisplay
from prime.data.leased import LeasedSequenceStream


class TrainerView(Protocol):
    config: PretrainConfig
    step: int  # inner steps taken
    tokens_seen: int
    optimizer: torch.optim.Optimizer  # the inner optimizer, whose moments a joiner takes from its peers
    metrics: MetricsWriter
    progress: ProgressDisplay
    leased: LeasedSequenceStream | None  # the data leased from the coordinator (None: not leased)

    def jump_to_step(self, step: int) -> None:
        """Sets the inner step (and the schedule with it) after an outer step or a catch-up."""

    def restart_data(self) -> None:
        """Restarts the batch iterator from the leased stream's committed position."""

    def prepare_data(self) -> None:
        """Reads the next batch ahead (leases and opens the shards it needs), off the next step's time."""
