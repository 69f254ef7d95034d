"""Seeded sampling that a verifier can replay: the token is a function of the logits and a seed only.

Gumbel-max: token = argmax over the nucleus of logits / T + g, where g is Gumbel noise drawn from a
counter-based hash of (seed, position in the completion, token id). Unlike a stateful generator, the
noise does not depend on the batch the rollout was generated in, the device, or how many tokens were
drawn before; so a verifier with the same logits and seed arrives at the same token, and one whose
logits differ by δ knows that the scores can differ by at most 2δ/T.

The hash is lowbias32 (Wellons), on int64 tensors masked to 32 bits after every step, so it gives the
same numbers on any device.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

_MASK = 0xFFFFFFFF


class SamplingParams(BaseModel):
    """How a completion is drawn; part of what a rollout claims and the verifier checks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0.0, le=100.0, description="Softmax temperature; 0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus: the smallest set of most likely tokens "
                         "whose probability reaches top_p.")
    max_tokens: int = Field(64, gt=0, description="Most tokens in a completion; it ends earlier at EOS.")


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x & _MASK
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _MASK
    return x ^ (x >> 16)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """U(0, 1) in float64, shape [rows, vocab], for the given seed and completion position of each row."""
    device = seeds.device
    seeds = seeds.to(torch.int64)
    per_row = _mix(_mix(seeds & _MASK) ^ _mix((seeds >> 32) + 0x9E3779B9) ^ _mix(positions.to(torch.int64) + 0x85EBCA6B))
    token = torch.arange(vocab_size, dtype=torch.int64, device=device)
    bits = _mix(per_row[:, None] ^ _mix(token + 0xC2B2AE35)[None, :])
    return (bits.to(torch.float64) + 0.5) / 2.0 ** 32


def nucleus_mass_above(probs: torch.Tensor) -> torch.Tensor:
    """For each token, the probability of the tokens strictly more likely than it (same shape)."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    above_sorted = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    return torch.empty_like(probs).scatter_(-1, order, above_sorted)


def scores(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What the sampler maximises (float64, [rows, vocab]); tokens outside the nucleus are -inf."""
    logits = logits.to(torch.float64)
    if params.temperature == 0:
        return logits
    scaled = logits / params.temperature
    noisy = scaled - torch.log(-torch.log(uniforms(seeds, positions, logits.shape[-1])))
    if params.top_p < 1.0:
        outside = nucleus_mass_above(torch.softmax(scaled, dim=-1)) >= params.top_p
        noisy = noisy.masked_fill(outside, float("-inf"))
    return noisy


def sample(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return scores(logits, seeds, positions, params).argmax(dim=-1)


def logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log p(token) under the temperature-scaled distribution (before the nucleus cut); at temperature 0
    under the model's own distribution. This is what a rollout reports and RL's importance ratios use."""
    temperature = params.temperature or 1.0
    return torch.log_softmax(logits.to(torch.float32) / temperature, dim=-1).gather(-1, tokens[..., None])[..., 0]
