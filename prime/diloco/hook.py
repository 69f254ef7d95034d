"""DiLoCo's outer loop, as the inner loop sees it: one interface (OuterLoop, a StepHook with state of
its own for checkpoints) and the mode that implements it.

Every `inner_steps` steps the node takes part in an outer step: pseudo-gradients (outer params −
inner params), the compressed all-reduce, the outer Nesterov step. Each local rank owns fp32 CPU
copies of its FSDP2 shards (the outer params, outer_optimizer.py); its global group pairs it with the
same shard on every other node.

- diloco.mode = blocking (blocking.py): the inner steps wait for the outer step.
- delayed, streaming (overlapped.py): the outer step of round k (or of one of F fragments every H/F
  steps) is decided in a background thread while the next inner steps run, and applied late, keeping
  the local progress made meanwhile.

The round is all-or-nothing: the pseudo-gradients stay intact until the coordinator says every
member's all-reduce succeeded ("apply"); on "abort" the same pseudo-gradients go into a retry with the
survivors. A node never applies its own pseudo-gradient alone. A node that is behind catches up from
its peers while the others go on (catch_up.py) and enters the next round with everyone; what it
serves them is publisher.py's. Faults enter only through the OuterStepFaults seam (faults.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from elastic_mesh import ElasticDeviceMesh
from prime.diloco.blocking import BlockingOuterLoop
from prime.diloco.config import DilocoConfig
from prime.diloco.error_feedback import ErrorFeedback
from prime.diloco.faults import OuterStepFaults
from prime.diloco.outer_optimizer import OuterOptimizer
from prime.diloco.overlapped import OverlappedOuterLoop
from prime.diloco.replica import DilocoReplica
from prime.diloco.trainer_view import TrainerView


class OuterLoop(Protocol):
    """A StepHook of the pretraining loop (prime/pretrain/trainer.py) that also saves state of its own."""

    def on_start(self, trainer: TrainerView) -> None:
        """Before the first inner step: serve the state resumed, or catch up with a running job."""

    def after_step(self, trainer: TrainerView, step: int) -> dict | None:
        """After every inner step; returns the record of an outer step applied now, if any."""

    def on_end(self, trainer: TrainerView) -> None:
        """After the last step: end on the last average, and keep serving while peers are behind."""

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """What a resumed node needs besides the model and the inner optimizer."""


def build_outer_loop(model: torch.nn.Module, mesh: ElasticDeviceMesh, config: DilocoConfig, outer: OuterOptimizer,
                     work_dir: Path, faults: OuterStepFaults | None = None,
                     restored_step: int = 0,
                     error_feedback: ErrorFeedback | None = None) -> BlockingOuterLoop | OverlappedOuterLoop:
    """The outer loop of diloco.mode over one replica's state. restored_step: the outer step a resumed
    node's checkpoint holds (0: it did not resume). error_feedback: the sparse compression's residual."""
    replica = DilocoReplica(model, mesh, config, outer, work_dir, faults, error_feedback)
    replica.outer_step = restored_step
    return BlockingOuterLoop(replica) if config.mode == "blocking" else OverlappedOuterLoop(replica)
