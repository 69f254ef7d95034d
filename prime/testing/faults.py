"""Faults a node can inflict on itself at a chosen moment, for tests and the chaos suite.

Off by default (every field 0). A kill is a real SIGKILL of the whole node (the torchrun agent and
all local ranks), the same as `kill -9` from outside, but at an exact phase.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

from elastic_mesh.control.process_tree import kill_tree
from elastic_mesh.transfer.fetcher import Snapshot
from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)


class ChaosConfig(BaseModel):
    """Self-inflicted faults (testing only)."""

    model_config = ConfigDict(extra="forbid")

    kill_at_inner_step: int = Field(0, ge=0, description="SIGKILL the node after this inner step (0: never).")
    kill_in_allreduce_at: int = Field(
        0, ge=0, description="SIGKILL the node between the two phases of this outer step's all-reduce (0: never).")
    nan_at_outer_step: int = Field(0, ge=0, description="Send a NaN pseudo-gradient at this outer step (0: never).")
    outlier_at_outer_step: int = Field(
        0, ge=0, description="Send a finite pseudo-gradient 10,000× too large at this outer step, for the peers' "
                             "outlier check to refuse (0: never).")
    step_delay_s: float = Field(0.0, ge=0, description="Sleep this long after every inner step (a slow node).")
    control_dir: str = Field(
        "", description="A directory a fault injector drops commands into while the node runs: a file `nan` "
                        "poisons the next pseudo-gradient, `kill-in-allreduce` kills the node between the phases of "
                        "the next all-reduce, `corrupt-serving` (text: seconds) serves the snapshots it publishes "
                        "in that time with a bit flipped in every chunk, `slow-serving` (text: seconds) delays every chunk it "
                        "serves from then on ('' : none).")


def take_command(config: ChaosConfig, name: str) -> bool:
    """True once per command file dropped into control_dir (the first local rank to claim it wins)."""
    return take_command_text(config, name) is not None


def take_command_text(config: ChaosConfig, name: str) -> str | None:
    """The text of a command file dropped into control_dir, once (None: no such command now)."""
    if not config.control_dir:
        return None
    path = Path(config.control_dir) / name
    taken = path.with_name(f".{name}.taken.{os.getpid()}")
    try:
        path.rename(taken)  # atomic: exactly one claimant
    except OSError:
        return None
    log.warning("chaos: command %r taken from %s", name, config.control_dir)
    return taken.read_text().strip()


def corrupted(snapshot: Snapshot) -> Snapshot:
    """The same manifest over bytes with one bit flipped in every chunk: what a faulty disk, a bad NIC or
    a lying peer would serve. Fetchers must notice chunk by chunk and take those chunks elsewhere."""
    blob, size = bytearray(snapshot.blob), snapshot.manifest["chunk_bytes"]
    for offset in range(0, len(blob), size):
        blob[offset] ^= 0x01
    return Snapshot(snapshot.step, snapshot.manifest, bytes(blob))


def kill_node(reason: str) -> None:
    log.warning("chaos: killing this node (%s)", reason)
    for handler in logging.getLogger().handlers:
        handler.flush()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # The torchrun agent and every local rank, as when the machine dies.
        kill_tree(os.getppid())
    os.kill(os.getpid(), signal.SIGKILL)
