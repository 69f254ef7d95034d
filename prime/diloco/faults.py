"""The seam through which faults enter an outer step: the DiLoCo hook calls these at the moments a
fault can strike, and does nothing else with them. Production runs the no-op `NoFaults`; tests and
the chaos harness install prime/chaos/faults.py's FaultHook, configured apart from the job."""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from elastic_mesh import Chunked


class OuterStepFaults(Protocol):
    def pseudo_gradient(self, pseudo: torch.Tensor, outer_step: int) -> None:
        """May poison the pseudo-gradient in place before it is sent."""

    def allreduce_phase(self, outer_step: int, phase: str) -> None:
        """Called when the node gets its place in an attempt ('go', before the rendezvous) and between the
        phases of the all-reduce ('scatter'); may kill or stall the node."""

    def decided(self, outer_step: int) -> None:
        """Called once the outer step is decided for this node, before it applies it and commits its hash;
        may stall the node."""

    def serving(self, kind: str, outer_step: int) -> Callable[[Chunked], Chunked] | None:
        """A rewrite of what is served for this kind and step (corrupted bytes), or None."""


class NoFaults:
    def pseudo_gradient(self, pseudo: torch.Tensor, outer_step: int) -> None:
        return None

    def allreduce_phase(self, outer_step: int, phase: str) -> None:
        return None

    def decided(self, outer_step: int) -> None:
        return None

    def serving(self, kind: str, outer_step: int) -> Callable[[Chunked], Chunked] | None:
        return None
