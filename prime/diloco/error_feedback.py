"""Error feedback for sparse pseudo-gradients: what a node's contributions have left unsent so far.

A sparse contribution carries ~1.6 % of the values, each in 2 bits. What it leaves out is not lost:
the node keeps it (the residual, fp32, the size of its shards) and adds it, decayed, to its next
pseudo-gradient, so a direction too small to be sent in one round is sent once it has built up
(SparseLoCo's error feedback; with decay < 1 old leftovers fade, and the residual acts as the outer
momentum, which is why SparseLoCo runs without one).

The residual is node state, as the outer params are:
- it changes only when the node's contribution entered an applied average: residual ← what was
  offered − what everyone decoded. A round the node missed, or in which its contribution was refused,
  leaves it as it was (that round's reading is rewound and read again, so its pseudo-gradient is not
  owed);
- it is saved with every checkpoint and restored on resume;
- a node that joins starts with zeros (it owes nothing), and one that catches up after missed rounds
  keeps its own (what it owes is from rounds the run committed);
- a node that leaves takes it along: nobody else sends what one node left unsent.
Streaming fragments are consecutive runs of the flat parameters, so each owns a slice of the residual
and fragments in flight never touch the same values.
"""

from __future__ import annotations

import torch


class ErrorFeedback:
    def __init__(self, total: int, decay: float) -> None:
        self.residual = torch.zeros(total)
        self.decay = decay

    def compensate(self, pseudo: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
        """What the node offers for the values span[0]:span[1]: its pseudo-gradient plus its decayed residual."""
        lo, hi = span
        if hi - lo != pseudo.numel():
            raise ValueError(f"a pseudo-gradient of {pseudo.numel()} values for a span of {hi - lo}")
        return pseudo + self.decay * self.residual[lo:hi]

    def settle(self, span: tuple[int, int], offered: torch.Tensor, sent: torch.Tensor | None) -> None:
        """After an applied outer step: the residual is what was offered less what was sent (everyone's
        decoding of it); `sent` None (the contribution was left out) leaves the residual as it was."""
        if sent is not None:
            lo, hi = span
            self.residual[lo:hi] = offered - sent

    def state_tensor(self) -> torch.Tensor:
        return self.residual.clone()

    def load_state_tensor(self, state: torch.Tensor) -> None:
        if state.numel() != self.residual.numel():
            raise ValueError(f"a saved residual of {state.numel()} values for shards of {self.residual.numel()}: "
                             "the checkpoint is of another model or another sharding")
        if not bool(torch.isfinite(state).all()):
            raise ValueError("the saved residual holds non-finite values")
        self.residual.copy_(state.reshape(-1))
