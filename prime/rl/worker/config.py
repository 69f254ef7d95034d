"""An inference worker's settings: how it computes and how much it keeps in flight. Where it keeps its
files and how others reach it are flags (python -m prime.rl.worker --help)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class WorkerConfig(BaseModel):
    """How an inference worker generates; what it generates (task, sampling, seeds) is the orchestrator's."""

    model_config = ConfigDict(extra="forbid")

    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute dtype (claimed in every rollout; the verifier holds it to that dtype's limits).")
    threads: int = Field(1, ge=1, le=512, description="Torch threads for generation.")
    wait_s: float = Field(600.0, gt=0, description="How long to wait for the first policy version to be published.")
    in_flight: int = Field(2, ge=1, le=8, description="Submissions awaiting the orchestrator's verification at once "
                           "(generating goes on meanwhile).")
    fetch_wait_s: float = Field(30.0, gt=0, description="How long a lease on a version this worker does not hold "
                                "yet waits for its follower to bring it, before fetching it itself.")
