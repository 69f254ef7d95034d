"""TOPLOC thresholds: measured by `prime.verify.calibrate` on honest generations, stored next to the
model (`<model dir>/toploc.json`), read by the verifier. No threshold is a constant in the code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from prime.verify.proof import ProofSettings

FILENAME = "toploc.json"
ComputeDtype = Literal["float32", "bfloat16", "float16"]


def logit_scale(logits: torch.Tensor) -> torch.Tensor:
    """Per row: the largest |logit|, at least 1. Logit and logprob noise are bounded in this unit, so a
    calibration on a fresh policy (logits near 0) still holds once training has made them large."""
    return logits.abs().amax(dim=-1).clamp(min=1.0)


class HonestMaxima(BaseModel):
    """The largest honest deviation seen, per statistic, before the margin is applied."""

    model_config = ConfigDict(extra="forbid")

    exponent_mismatches: int = Field(ge=0)
    mantissa_mean: float = Field(ge=0)
    rollout_mantissa_mean: float = Field(ge=0)
    logit_noise: float = Field(ge=0)
    logprob_noise: float = Field(ge=0)
    deviating_chunks: float = Field(0.0, ge=0, le=1, description="The share of honest chunk proofs that differ "
                                    "from the recomputation at all (ChunkComparison.deviates); over all conditions "
                                    "together, not the largest.")


class Limits(BaseModel):
    """What an honest worker computing in one dtype may deviate from the verifier's float32 recomputation."""

    model_config = ConfigDict(extra="forbid")

    exponent_mismatches: int = Field(ge=0, description="Per chunk: top-k positions whose proof value has "
                                     "another sign or exponent; as many positions may lie outside the prover's "
                                     "top k (ChunkComparison.trimmed).")
    mantissa_mean: float = Field(ge=0, description="Per chunk: mean |mantissa difference| in fp16 ULPs over the "
                                 "positions not set aside as outside the prover's top k.")
    rollout_mantissa_mean: float = Field(ge=0, description="The same mean over all chunks of a rollout; "
                                         "tighter, because honest noise averages out and a changed model does not.")
    logit_noise: float = Field(gt=0, description="Bound δ on |logit difference| per unit of the position's "
                               "largest |logit| (at least 1); the sampling check allows a score gap of 2δ·scale/T "
                               "between the claimed token and the seed's pick.")
    logprob_noise: float = Field(gt=0, description="Bound on |reported - recomputed logprob| at temperature 1, per "
                                 "unit of the position's largest |logit| (divided by T at other temperatures).")
    deviation_rate: float | None = Field(None, gt=0, le=1, description="Bound on the share of an honest worker's "
                                         "chunk proofs that differ at all: the orchestrator tests each worker's own "
                                         "share against it over time (prime/rl/orchestrator/evidence.py). None: thresholds "
                                         "calibrated before it existed; no such test.")


class Calibration(BaseModel):
    """Where the thresholds came from, so an operator can tell whether they fit the workers' hardware."""

    model_config = ConfigDict(extra="forbid")

    date: str
    torch: str
    device: str
    chunks: int = Field(gt=0, description="Honest chunk proofs measured.")
    tokens: int = Field(gt=0)
    conditions: list[str] = Field(description="Thread counts, batch sizes, dtypes, prompt lengths tried.")
    margin: float = Field(gt=1)
    honest_maxima: dict[ComputeDtype, HonestMaxima]


class ToplocThresholds(BaseModel):
    """Per worker compute dtype, how far an honest rollout may deviate from the verifier's recomputation.

    A worker says which dtype it computed in; it is held to that dtype's limits, and a dtype the
    calibration did not cover is refused. So allowing bfloat16 workers (whose honest deviation is
    hundreds of times a float32 worker's) does not loosen the check on a worker that claims float32.
    """

    model_config = ConfigDict(extra="forbid")

    proof: ProofSettings = Field(description="The shape of the proofs these thresholds were measured for.")
    limits: dict[ComputeDtype, Limits] = Field(description="Per allowed worker compute dtype; see Limits.")
    calibration: Calibration = Field(description="Where the thresholds came from: date, torch, device, chunks, "
                                     "conditions, margin, honest maxima.")

    @classmethod
    def load(cls, model_dir: str | Path) -> "ToplocThresholds":
        path = Path(model_dir) / FILENAME
        if not path.is_file():
            raise FileNotFoundError(f"no TOPLOC thresholds at {path}; measure them on this model with "
                                    f"`python -m prime.verify.calibrate --model {model_dir}`")
        try:
            return cls.model_validate(json.loads(path.read_text()))
        except ValueError as error:
            raise ValueError(f"{path} is not a valid thresholds file: {error}") from error

    def save(self, model_dir: str | Path) -> Path:
        path = Path(model_dir) / FILENAME
        temporary = path.with_suffix(".json.tmp")
        temporary.write_text(self.model_dump_json(indent=2) + "\n")
        temporary.replace(path)
        return path
