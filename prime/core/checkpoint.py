"""Checkpoints with torch.distributed.checkpoint: model, optimizer, schedule, data position, step.

A checkpoint is written into a hidden temp directory and renamed into place by rank 0 once every rank
has finished, so a crash mid-save leaves the previous checkpoint intact and never a half one that
looks complete. Only the newest `keep` are kept.

In the background (the default), save() copies the state in memory and returns; a writer thread per
rank writes the copy, with its own Gloo group for DCP's collectives so they never interleave with the
training's, and rank 0 renames the directory once every rank has written. A complete checkpoint can
also be copied to a remote path with fsspec (trainer.json last: a copy without it is incomplete).
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import BaseModel, ConfigDict, Field
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

log = logging.getLogger(__name__)

_PREFIX = "step_"


class CheckpointConfig(BaseModel):
    """When and where checkpoints are written."""

    model_config = ConfigDict(extra="forbid")

    every: int = Field(100, ge=0, description="Inner steps between checkpoints (0: only at the end).")
    keep: int = Field(3, ge=1, description="Newest checkpoints kept on disk; older ones are deleted.")
    dir: str | None = Field(None, description="Directory of checkpoints (default: RUN_DIR/checkpoints).")
    background: bool = Field(True, description="Write checkpoints in a background thread from an in-memory copy "
                             "(training stalls only for the copy); false: write before the next step.")
    remote: str | None = Field(None, description="Also copy every complete checkpoint here with fsspec "
                               "(e.g. s3://bucket/run or /mnt/backup/run), by the checkpoint's writer; all are kept.")


class CheckpointStore:
    """Saves and finds checkpoints under one directory; every rank of the local group calls save/load."""

    def __init__(self, root: Path, keep: int, rank: int, world_size: int, background: bool = False,
                 remote: str | None = None) -> None:
        self.root, self.keep, self.rank, self.world_size = Path(root), keep, rank, world_size
        self.background, self.remote = background, remote
        self._writer: threading.Thread | None = None
        self._failure: BaseException | None = None
        # DCP's collectives from the writer thread go over a group of their own (every rank creates it here).
        self._group = dist.new_group(backend="gloo") if background and dist.is_initialized() else None

    def path_for(self, step: int) -> Path:
        return self.root / f"{_PREFIX}{step:08d}"

    def latest(self) -> Path | None:
        if not self.root.is_dir():
            return None
        complete = sorted(p for p in self.root.iterdir() if p.name.startswith(_PREFIX) and (p / "trainer.json").exists())
        return complete[-1] if complete else None

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             trainer_state: dict, rank_state: dict, rank_tensors: dict[str, torch.Tensor] | None = None) -> Path:
        """Returns where the checkpoint will be complete (at once, or once the writer is done).
        rank_tensors: state of this rank that is not the model's or the optimizer's (DiLoCo's outer
        optimizer), stored beside them and read back with load_rank_tensors."""
        self.wait()  # one checkpoint in flight at a time
        final = self.path_for(step)
        staging = self.root / f".{final.name}.tmp"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
        dist.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        trainer_state = {**trainer_state, "world_size": self.world_size}
        if not self.background:
            self._write(state, rank_state, rank_tensors, trainer_state, staging, final, None)
            return final
        # The copy is the only stall: training may change the live tensors as soon as save() returns.
        state, rank_tensors = _copied(state), _copied(rank_tensors)
        self._writer = threading.Thread(target=self._write_in_background, name=f"checkpoint-{step}", daemon=True,
                                        args=(state, rank_state, rank_tensors, trainer_state, staging, final))
        self._writer.start()
        return final

    def _write_in_background(self, *args) -> None:
        started = time.perf_counter()
        try:
            self._write(*args, self._group)
        except BaseException as e:  # surfaced by the next save() or wait(), on the training thread
            self._failure = e
            return
        if self.rank == 0:
            log.info("checkpoint %s written in the background in %.1f s", args[-1].name, time.perf_counter() - started)

    def _write(self, state: dict, rank_state: dict, rank_tensors: dict | None, trainer_state: dict, staging: Path,
               final: Path, group) -> None:
        dcp.save(state, checkpoint_id=str(staging), process_group=group)
        (staging / f"rank{self.rank:04d}.json").write_text(json.dumps(rank_state))
        if rank_tensors:
            torch.save(rank_tensors, staging / f"rank{self.rank:04d}.tensors.pt")
        dist.barrier(group=group)
        if self.rank == 0:
            (staging / "trainer.json").write_text(json.dumps(trainer_state))
            shutil.rmtree(final, ignore_errors=True)
            staging.rename(final)
            self._prune()
            if self.remote:
                self._copy_to_remote(final)
        dist.barrier(group=group)

    def wait(self) -> None:
        """Until the checkpoint in flight is complete; raises if writing it failed."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise RuntimeError(f"writing a checkpoint in the background failed: {failure}") from failure

    def _copy_to_remote(self, final: Path) -> None:
        """Copies a complete checkpoint with fsspec; trainer.json goes last, so a reader of the remote
        copy can tell a complete one from one cut short."""
        import fsspec

        fs, root = fsspec.core.url_to_fs(self.remote)
        target = f"{root.rstrip('/')}/{final.name}"
        files = sorted((p for p in final.rglob("*") if p.is_file()), key=lambda p: (p.name == "trainer.json", str(p)))
        try:
            for path in files:
                destination = f"{target}/{path.relative_to(final).as_posix()}"
                fs.makedirs(destination.rsplit("/", 1)[0], exist_ok=True)
                fs.put_file(str(path), destination)
        except Exception as e:  # a remote that is down must not stop training; the local copy is complete
            log.warning("checkpoint %s not copied to %s: %s", final.name, self.remote, e)
            return
        log.info("checkpoint %s copied to %s", final.name, self.remote)

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

    def _prune(self) -> None:  # rank 0
        complete = sorted(p for p in self.root.iterdir() if p.name.startswith(_PREFIX))
        for old in complete[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
            log.debug("deleted old checkpoint %s (keeping the newest %d)", old.name, self.keep)


def _copied(value):
    """A copy of a (nested) state dict whose tensors training can no longer change."""
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value
