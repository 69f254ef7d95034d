"""What a DiLoCo node serves its peers after each committed outer step: the snapshot of that step (the
outer state), the averaged update that made it (the all-reduce's own encoded bytes) and its inner
AdamW moments, so a node that is behind replays or fetches instead of stalling anyone. Served from the
node's transfer server, laid out and hashed only when a peer first asks."""

from __future__ import annotations

import threading

import torch

from elastic_mesh import AllReduceResult, ElasticDeviceMesh
from prime.core.optim import adam_state_tensors
from prime.diloco.config import DilocoConfig
from prime.diloco.faults import OuterStepFaults
from prime.diloco.outer_optimizer import OuterOptimizer


class SnapshotPublisher:
    def __init__(self, model: torch.nn.Module, mesh: ElasticDeviceMesh, config: DilocoConfig, outer: OuterOptimizer,
                 faults: OuterStepFaults) -> None:
        self.model, self.mesh, self.config, self.outer, self.faults = model, mesh, config, outer, faults
        self._thread: threading.Thread | None = None

    def serve(self, step: int, tensors: dict[str, torch.Tensor], kind: str, meta: dict | None = None) -> None:
        """Published deferred: laid out and hashed when a peer first asks (every tensor here is a copy
        made for serving, or the all-reduce's own bytes, which nothing writes again)."""
        self.mesh.serve(kind, step, tensors, meta, self.faults.serving(kind, step))

    def publish(self, step: int, result: AllReduceResult | None, optimizer: torch.optim.Optimizer) -> None:
        """Snapshot of step k and the update that made it, published in the background (the outer state does
        not change until the next outer step, which waits for this thread first). The update travels as
        the all-reduce's own encoded bytes: int8 is ~3.9× smaller than the fp32 mean, and decodes to it
        exactly (a sparse exchange: the contributions' bytes, ~200× smaller). The inner AdamW moments are copied now (the next inner step changes them) and served
        too, so a joiner does not start from empty moments. result None: resumed from a checkpoint (the
        state, without the update that made it)."""
        if not self.config.serve_snapshots:
            return
        state = self.outer.state_tensor()
        self.serve(step, self.inner_moments(optimizer), "inner")
        if result is None:
            self.serve(step, {"state": state}, "snapshot")
            return
        self._thread = threading.Thread(target=self.serve_state_and_update, args=(step, state, result),
                                        daemon=True, name="snapshot-publisher")
        self._thread.start()

    def inner_moments(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        return adam_state_tensors(optimizer, list(self.model.parameters()))

    def serve_state_and_update(self, step: int, state: torch.Tensor | None, result: AllReduceResult,
                               fragment: int | None = None) -> None:
        if result.wire is not None:
            update = {"wire": result.wire}
            meta = {"codec": self.config.wire_format, "layout": result.layout}
        else:  # nobody contributed: the mean is zeros, sent as is
            update, meta = {"mean": result.mean}, {}
        if fragment is not None and self.config.fragment_count > 1:
            meta["fragment"] = fragment
        if state is not None:
            self.serve(step, {"state": state}, "snapshot")
        self.serve(step, update, "update", meta)

    def wait(self) -> None:
        """Until the last step's snapshot is out (before the outer state changes again)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
