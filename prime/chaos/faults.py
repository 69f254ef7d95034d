"""Faults a node inflicts on itself at a chosen moment, for tests and the chaos suite.

A hook of its own beside the DiLoCo hook, configured apart from the job: `--chaos.*` options of
`prime.train` fill FaultConfig (not the JobConfig, whose fingerprint and config.json never see them),
and the hook is installed only when one is set. A kill is a real SIGKILL of the whole node (the
torchrun agent and all local ranks), the same as `kill -9` from outside, but at an exact phase.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import torch
from pydantic import BaseModel, ConfigDict, Field

from elastic_mesh import Chunked, kill_tree

log = logging.getLogger(__name__)

PREFIX = "chaos."  # the command-line options that configure this hook: --chaos.FIELD VALUE


class FaultConfig(BaseModel):
    """Self-inflicted faults (testing only; every field off by default)."""

    model_config = ConfigDict(extra="forbid")

    kill_at_inner_step: int = Field(0, ge=0, description="SIGKILL the node after this inner step (0: never).")
    kill_in_allreduce_at: int = Field(
        0, ge=0, description="SIGKILL the node between the two phases of this outer step's all-reduce (0: never).")
    nan_at_outer_step: int = Field(0, ge=0, description="Send a NaN pseudo-gradient at this outer step (0: never).")
    outlier_at_outer_step: int = Field(
        0, ge=0, description="Send a finite pseudo-gradient 10,000× too large at this outer step, for the peers' "
                             "outlier check to refuse (0: never).")
    step_delay_s: float = Field(0.0, ge=0, description="Sleep this long after every inner step (a slow node).")
    freeze_at_outer_step: int = Field(
        0, ge=0, description="Stop the node's processes (SIGSTOP) for freeze_s once this outer step is decided, "
                             "before the node applies it and commits its hash (0: never).")
    freeze_s: float = Field(0.0, ge=0, le=600, description="How long the freeze lasts (longer than the "
                                                           "coordinator's lease: the node is declared dead meanwhile).")
    hold_up_at_outer_step: int = Field(
        0, ge=0, description="Take a place in this outer step's round, then stay away from its rendezvous for "
                             "hold_up_s while the node keeps its heartbeats (a member that holds a round up; the "
                             "coordinator strikes it) (0: never).")
    hold_up_s: float = Field(60.0, ge=0, le=600, description="How long a hold-up lasts.")
    control_dir: str = Field(
        "", description="A directory a fault injector drops commands into while the node runs: a file `nan` "
                        "poisons the next pseudo-gradient, `kill-in-allreduce` kills the node between the phases of "
                        "the next all-reduce, `corrupt-serving` (text: seconds) serves the snapshots it publishes "
                        "in that time with a bit flipped in every chunk, `slow-serving` (text: seconds) delays every "
                        "chunk it serves from then on ('' : none).")

    @property
    def active(self) -> bool:
        return self != FaultConfig()


def corrupted(item: Chunked) -> Chunked:
    """The same manifest over bytes with one bit flipped in every chunk: what a faulty disk, a bad NIC or
    a lying peer would serve. Fetchers must notice chunk by chunk and take those chunks elsewhere."""
    blob, size = bytearray(item.blob), item.manifest["chunk_bytes"]
    for offset in range(0, len(blob), size):
        blob[offset] ^= 0x01
    return Chunked(item.version, item.manifest, bytes(blob))


def kill_node(reason: str) -> None:
    log.warning("chaos: killing this node (%s)", reason)
    for handler in logging.getLogger().handlers:
        handler.flush()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # The torchrun agent and every local rank, as when the machine dies.
        kill_tree(os.getppid())
    os.kill(os.getpid(), signal.SIGKILL)


def freeze_node(seconds: float) -> None:
    """SIGSTOP of this process (every thread: the heartbeat too), continued `seconds` later by a helper of
    its own session: what a stall of the whole machine (swap, a preempted VM, `kill -STOP`) looks like."""
    log.warning("chaos: freezing this node for %.1f s", seconds)
    for handler in logging.getLogger().handlers:
        handler.flush()
    subprocess.Popen(["sh", "-c", f"sleep {seconds:.3f}; kill -CONT {os.getpid()}"], start_new_session=True)
    os.kill(os.getpid(), signal.SIGSTOP)


class FaultHook:
    """A StepHook (after every inner step: kills, delays, commands dropped into control_dir) and the
    DiLoCo hook's OuterStepFaults (poison, kill mid-all-reduce, freeze after a decision, corrupt serving)."""

    def __init__(self, config: FaultConfig, server=None) -> None:
        """server: the node's transfer server (elastic_mesh ChunkServer), for slow serving."""
        self.config, self.server = config, server
        self._corrupt_until = 0.0  # what is published before this time.monotonic() is served corrupted
        self._held_up = False

    # ---- StepHook ------------------------------------------------------------------------------------
    def on_start(self, trainer) -> None:
        return None

    def on_end(self, trainer) -> None:
        return None

    def after_step(self, trainer, step: int) -> dict | None:
        if self.config.kill_at_inner_step and step == self.config.kill_at_inner_step:
            kill_node(f"inner step {step}")
        if self.config.step_delay_s:
            time.sleep(self.config.step_delay_s)
        if (text := self._take_text("corrupt-serving")) is not None:
            self._corrupt_until = time.monotonic() + float(text or 30)
        if (text := self._take_text("slow-serving")) is not None and self.server is not None:
            delay = float(text or 0.5)
            self.server.before_chunk = lambda kind, version, index: time.sleep(delay)
            log.warning("chaos: serving every chunk %.2f s late from now on", delay)
        return None

    # ---- OuterStepFaults -----------------------------------------------------------------------------
    def pseudo_gradient(self, pseudo: torch.Tensor, outer_step: int) -> None:
        if self.config.nan_at_outer_step == outer_step or self._take("nan"):
            pseudo[: max(1, pseudo.numel() // 100)] = float("nan")
        if self.config.outlier_at_outer_step == outer_step:
            pseudo.mul_(1e4)

    def allreduce_phase(self, outer_step: int, phase: str) -> None:
        if phase == "go" and self.config.hold_up_at_outer_step == outer_step and not self._held_up:
            self._held_up = True  # once: the retry the coordinator makes goes on without this node
            log.warning("chaos: holding outer step %d up for %.0f s (no rendezvous, heartbeats go on)",
                        outer_step, self.config.hold_up_s)
            time.sleep(self.config.hold_up_s)
        if phase == "scatter" and (self.config.kill_in_allreduce_at == outer_step or self._take("kill-in-allreduce")):
            kill_node(f"between the phases of outer step {outer_step}'s all-reduce")

    def decided(self, outer_step: int) -> None:
        if self.config.freeze_at_outer_step == outer_step and self.config.freeze_s:
            freeze_node(self.config.freeze_s)

    def serving(self, kind: str, outer_step: int) -> Callable[[Chunked], Chunked] | None:
        if time.monotonic() < self._corrupt_until:
            log.warning("chaos: serving the %s of outer step %d with a bit flipped in every chunk", kind, outer_step)
            return corrupted
        return None

    # ---- commands dropped into control_dir -----------------------------------------------------------
    def _take(self, name: str) -> bool:
        """True once per command file dropped into control_dir (the first local rank to claim it wins)."""
        return self._take_text(name) is not None

    def _take_text(self, name: str) -> str | None:
        """The text of a command file dropped into control_dir, once (None: no such command now)."""
        if not self.config.control_dir:
            return None
        path = Path(self.config.control_dir) / name
        taken = path.with_name(f".{name}.taken.{os.getpid()}")
        try:
            path.rename(taken)  # atomic: exactly one claimant
        except OSError:
            return None
        log.warning("chaos: command %r taken from %s", name, self.config.control_dir)
        return taken.read_text().strip()
