"""What a rollout worker asks of a generation engine, written as an interface.

The CPU engine (`HFEngine`) implements it with Hugging Face transformers; a GPU engine such as vLLM
fits the same interface as long as it samples with `prime.inference.sampling` and hands each decode
step's final hidden state to a `StepObserver`. The engine defines that seam and knows nothing of what
observes it: prime/verify's `ProofBuilder` is one (TOPLOC: all a verifier needs to check the output).
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


class StepObserver(Protocol):
    """Watches one batch's generation: every decode step's final hidden states, and at the end answers
    one commitment per row (a TOPLOC proof: prime.verify.proof.ProofBuilder)."""

    def add(self, hidden: torch.Tensor, active: torch.Tensor) -> None:
        """hidden [rows, hidden_size]: this step's final states; active [rows] bool: rows still generating."""

    def finish(self) -> list[bytes]:
        """The commitment of each row, in row order."""


class ObserverFactory(Protocol):
    """Makes the observer of one batch (rows, hidden size, device). An engine without one commits to
    nothing (empty proofs): held-out evaluation, the reference loop."""

    def __call__(self, rows: int, hidden_size: int, device: torch.device) -> StepObserver: ...


class InferenceEngine(Protocol):
    eos_id: int

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]: ...

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None: ...
