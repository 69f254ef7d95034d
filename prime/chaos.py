"""Faults a node can inflict on itself at a chosen moment, for tests and the chaos suite.

Off by default (every field 0). A kill is a real SIGKILL of the whole node (the torchrun agent and
all local ranks), the same as `kill -9` from outside, but at an exact phase.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

from elastic_mesh.process_tree import kill_tree
from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)


class ChaosConfig(BaseModel):
    """Self-inflicted faults (testing only)."""

    model_config = ConfigDict(extra="forbid")

    kill_at_inner_step: int = Field(0, ge=0, description="SIGKILL the node after this inner step (0: never).")
    kill_in_allreduce_at: int = Field(
        0, ge=0, description="SIGKILL the node between the two phases of this outer step's all-reduce (0: never).")
    nan_at_outer_step: int = Field(0, ge=0, description="Send a NaN pseudo-gradient at this outer step (0: never).")
    step_delay_s: float = Field(0.0, ge=0, description="Sleep this long after every inner step (a slow node).")
    control_dir: str = Field(
        "", description="A directory a fault injector drops commands into while the node runs: a file `nan` "
                        "poisons the next pseudo-gradient, `kill-in-allreduce` kills the node between the phases of "
                        "the next all-reduce ('' : none).")


def take_command(config: ChaosConfig, name: str) -> bool:
    """True once per command file dropped into control_dir (the first local rank to claim it wins)."""
    if not config.control_dir:
        return False
    path = Path(config.control_dir) / name
    try:
        path.rename(path.with_name(f".{name}.taken.{os.getpid()}"))  # atomic: exactly one claimant
    except OSError:
        return False
    log.warning("chaos: command %r taken from %s", name, config.control_dir)
    return True


def kill_node(reason: str) -> None:
    log.warning("chaos: killing this node (%s)", reason)
    for handler in logging.getLogger().handlers:
        handler.flush()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # The torchrun agent and every local rank, as when the machine dies.
        kill_tree(os.getppid())
    os.kill(os.getpid(), signal.SIGKILL)
