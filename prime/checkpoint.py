"""Checkpoints with torch.distributed.checkpoint: model, optimizer, schedule, data position, step.

A checkpoint is written into a hidden temp directory and renamed into place by rank 0 once every rank
has finished, so a crash mid-save leaves the previous checkpoint intact and never a half one that
looks complete. Only the newest `keep` are kept.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import BaseModel, ConfigDict, Field
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

log = logging.getLogger(__name__)

_PREFIX = "step_"


class CheckpointConfig(BaseModel):
    """When and where checkpoints are written."""

    model_config = ConfigDict(extra="forbid")

    every: int = Field(100, ge=0, description="Inner steps between checkpoints (0: only at the end).")
    keep: int = Field(3, ge=1, description="Newest checkpoints kept on disk; older ones are deleted.")
    dir: str | None = Field(None, description="Directory of checkpoints (default: RUN_DIR/checkpoints).")


class CheckpointStore:
    """Saves and finds checkpoints under one directory; every rank of the local group calls save/load."""

    def __init__(self, root: Path, keep: int, rank: int, world_size: int) -> None:
        self.root, self.keep, self.rank, self.world_size = Path(root), keep, rank, world_size

    def path_for(self, step: int) -> Path:
        return self.root / f"{_PREFIX}{step:08d}"

    def latest(self) -> Path | None:
        if not self.root.is_dir():
            return None
        complete = sorted(p for p in self.root.iterdir() if p.name.startswith(_PREFIX) and (p / "trainer.json").exists())
        return complete[-1] if complete else None

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             trainer_state: dict, rank_state: dict, rank_tensors: dict[str, torch.Tensor] | None = None) -> Path:
        """rank_tensors: state of this rank that is not the model's or the optimizer's (DiLoCo's outer
        optimizer), stored beside them and read back with load_rank_tensors."""
        final = self.path_for(step)
        staging = self.root / f".{final.name}.tmp"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
        dist.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(staging))
        (staging / f"rank{self.rank:04d}.json").write_text(json.dumps(rank_state))
        if rank_tensors:
            torch.save(rank_tensors, staging / f"rank{self.rank:04d}.tensors.pt")
        dist.barrier()
        if self.rank == 0:
            (staging / "trainer.json").write_text(json.dumps({**trainer_state, "world_size": self.world_size}))
            shutil.rmtree(final, ignore_errors=True)
            staging.rename(final)
            self._prune()
        dist.barrier()
        return final

    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """Restores model (and optimizer) in place; returns (trainer state, this rank's state)."""
        path = Path(path)
        trainer_file = path / "trainer.json"
        if not trainer_file.exists():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no trainer.json); pick another one")
        trainer_state = json.loads(trainer_file.read_text())
        if trainer_state["world_size"] != self.world_size:
            raise ValueError(
                f"checkpoint {path} was written by {trainer_state['world_size']} local ranks but this run has "
                f"{self.world_size}; resume with --nproc-per-node {trainer_state['world_size']}"
            )
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        rank_state = json.loads((path / f"rank{self.rank:04d}.json").read_text())
        return trainer_state, rank_state

    def load_rank_tensors(self, path: Path) -> dict[str, torch.Tensor] | None:
        file = Path(path) / f"rank{self.rank:04d}.tensors.pt"
        if not file.exists():
            return None
        return torch.load(file, weights_only=True)  # tensors only: nothing in the file is executed

    @staticmethod
    def load_model(path: Path, model: torch.nn.Module) -> None:
        """Loads only the weights, into a model with any sharding (or none) and any number of ranks."""
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"])

    def _prune(self) -> None:
        complete = sorted(p for p in self.root.iterdir() if p.name.startswith(_PREFIX))
        for old in complete[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
            log.info("deleted old checkpoint %s (keeping the newest %d)", old.name, self.keep)
