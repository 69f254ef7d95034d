"""What a rollout worker asks of a generation engine, written as an interface.

The CPU engine (`HFEngine`) implements it with Hugging Face transformers; a GPU engine such as vLLM
fits the same interface as long as it samples with `prime.inference.sampling` and hands each decode
step's final hidden state to a `ProofBuilder`, which is all a verifier needs to check its output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, Sequence

import torch

from prime.inference.sampling import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    """One completion to draw: the prompt's token ids, the seed the orchestrator handed out, the sampling."""

    prompt: list[int]
    seed: int
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Completion:
    """What a worker returns for a request; everything here is a claim until verified."""

    tokens: list[int]
    logprobs: list[float]  # log p of each token at the sampling temperature (see sampling.logprobs)
    finish_reason: Literal["eos", "length"]
    proof: bytes  # TOPLOC chunk proofs, concatenated
    compute_dtype: str = "float32"  # what the worker says it computed in; held to that dtype's limits
    logits: torch.Tensor | None = None  # [tokens, vocab] float32, only when asked for (calibration)


@dataclass
class GenerationStats:
    """Where a generate call spent its time (seconds); the benchmark reports proof_s / total_s."""

    total_s: float = 0.0
    proof_s: float = 0.0
    tokens: int = 0


class InferenceEngine(Protocol):
    eos_id: int

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]: ...

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None: ...
