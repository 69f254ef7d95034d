"""TOPLOC proofs: what an inference worker commits to while it generates, and how a verifier compares.

For every `chunk_tokens` (32) new tokens the worker takes the k (128) largest-magnitude entries of the
final hidden states (after the last norm; the states whose logits chose those tokens), flattened over
the chunk, and commits to their positions and fp16 values as one polynomial (`encoding`): 258 bytes.

fp16, not bf16 as in the paper: the same 16 bits hold 3 more mantissa bits, so the verifier sees a
changed weight or precision 8× sooner, and the final norm's outputs are far inside fp16's range.

Comparison: the verifier takes the top k of its own recomputed states and reads the proof's value at
each of those positions. A position where sign or exponent differ counts as an exponent mismatch (it is
not in the prover's top k, or the value moved across a power of two); at the others the mantissas
differ by some units in the last place (ULPs). These three numbers per chunk are what the calibrated
thresholds bound.

A position of the verifier's top k that is not in the prover's (the two recomputations order a near-tie
at the k-th magnitude differently) reads a value the prover never committed to: the polynomial
evaluated elsewhere. Its sign and exponent usually differ from the verifier's (an exponent mismatch),
but about 1 time in 50 they agree by chance, and its mantissa difference is noise of up to 1023 ULPs.
So `ChunkComparison.trimmed` sets aside as many of the largest mantissa differences as the threshold
allows positions outside the prover's set, less those already shown by their exponent.

A run of near-equal values straddling the cut (a dimension that saturates after the final norm: seen with
7 values within 3e-7 of each other) lets honest noise swap several of them across it, more than the
threshold allows. So positions of the verifier's top k whose magnitude is within TIE_RELATIVE of its k-th
are not compared at all: either side may have kept them. What that hides is values at the cut, the least
telling of all; everything above it is compared as before.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field

from prime.inference.engine import ObserverFactory
from prime.verify import encoding


class ProofSettings(BaseModel):
    """The shape of a proof; the calibration records it, and a verifier refuses proofs of another shape."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    chunk_tokens: int = Field(32, gt=0, le=1024, description="New tokens covered by one chunk proof.")
    topk: int = Field(128, ge=8, le=4096, description="Largest activations committed to per chunk.")

    @property
    def chunk_bytes(self) -> int:
        return 2 * (self.topk + 1)

    def chunks_for(self, tokens: int) -> int:
        return -(-tokens // self.chunk_tokens)


def top_values(states: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and fp16 bit patterns of the k largest-magnitude entries of each row's [n, hidden] states
    (rows [R, n, hidden], flattened row-major, so a shorter chunk padded with zeros at the end keeps its
    positions)."""
    flat = states.reshape(states.shape[0], -1).to(torch.float32)
    positions = flat.abs().topk(topk, dim=-1, sorted=False).indices
    return positions, fp16_bits(flat.gather(-1, positions))


def fp16_bits(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF


def encode(positions: torch.Tensor, bits: torch.Tensor) -> list[bytes]:
    moduli = encoding.pick_modulus(positions)
    coefficients = encoding.interpolate(positions % moduli[:, None], bits)
    return encoding.pack(moduli, coefficients)


def proof_observer(settings: ProofSettings) -> ObserverFactory:
    """What an engine is handed to build TOPLOC proofs of this shape while it generates."""
    return functools.partial(ProofBuilder, settings)


class ProofBuilder:
    """A `StepObserver` (prime.inference.engine). Collects the final hidden state of every decode step for a batch of rows, takes each chunk's top k
    as soon as the chunk is complete, and encodes everything at the end in one batched call (so the
    polynomial work is paid once per batch, not once per chunk)."""

    def __init__(self, settings: ProofSettings, rows: int, hidden_size: int, device: torch.device) -> None:
        if settings.topk > hidden_size:
            raise ValueError(f"proof top-k {settings.topk} exceeds the hidden size {hidden_size}: a one-token "
                             "chunk would have too few activations; lower proof.topk")
        self.settings = settings
        self._window = torch.zeros(rows, settings.chunk_tokens, hidden_size, dtype=torch.float32, device=device)
        self._active: list[torch.Tensor] = []  # per decode step of the current window: rows still generating
        self._chunks: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(rows)]

    def add(self, hidden: torch.Tensor, active: torch.Tensor) -> None:
        """hidden [rows, hidden_size]: this step's final state; active [rows] bool: rows still generating.
        One copy per step: everything else waits for the window to close."""
        self._window[:, len(self._active)] = hidden
        self._active.append(active)
        if len(self._active) == self.settings.chunk_tokens:
            self._close_window()

    def _close_window(self) -> None:
        if not self._active:
            return
        active = torch.stack(self._active, dim=1)  # [rows, steps]
        steps = active.shape[1]
        # A row that ended inside the window gets zeros after its last state (never in the top k: they
        # are the smallest magnitudes), so its positions are those of a chunk of its own length.
        window = self._window[:, :steps] * active[:, :, None]
        rows = active.any(dim=1).nonzero()[:, 0]
        if len(rows):
            positions, bits = top_values(window[rows], self.settings.topk)
            for i, row in enumerate(rows.tolist()):
                self._chunks[row].append((positions[i], bits[i]))
        self._active = []

    def finish(self) -> list[bytes]:
        """One proof per row: its chunk proofs concatenated in order."""
        self._close_window()
        flat = [chunk for row in self._chunks for chunk in row]
        if not flat:
            return [b"" for _ in self._chunks]
        encoded = iter(encode(torch.stack([p for p, _ in flat]), torch.stack([b for _, b in flat])))
        return [b"".join(next(encoded) for _ in row) for row in self._chunks]


TIE_RELATIVE = 2.0 ** -14  # a magnitude this close (relative) to the k-th is at the cut: float32 noise is ~1e-7
LARGEST_KEPT = 8  # more than any threshold on exponent mismatches calibrated so far for float32 (1)


@dataclass(frozen=True)
class ChunkComparison:
    """How one chunk of recomputed states compares with the proof."""

    exponent_mismatches: int  # of the verifier's top k above the cut: positions whose proof value has another sign or exponent
    mantissa_mean: float  # mean |mantissa difference| in fp16 ULPs over the other positions
    mantissa_max: int
    matched: int  # positions compared by mantissa (topk - exponent_mismatches - those at the cut)
    mantissa_sum: int
    largest: tuple[int, ...] = ()  # the largest mantissa differences, largest first (LARGEST_KEPT of them)

    @property
    def deviates(self) -> bool:
        """Whether any compared position differs at all: rare for an honest float32 worker, the rule for
        slightly wrong weights (what the per-worker evidence counts over time)."""
        return self.exponent_mismatches > 0 or self.mantissa_sum > 0

    def trimmed(self, unmatched_allowed: int) -> tuple[int, int]:
        """(positions compared, their summed mantissa difference) once up to `unmatched_allowed` positions
        are taken as outside the prover's top k: those with another sign or exponent first, then the
        largest mantissa differences (a value read outside the prover's set whose exponent agreed by
        chance). An honest chunk with a near-tie at the k-th magnitude evicted a worker before this (one
        chunk in some 10^5: 0.625 ULP mean from one position, logits and logprobs exact)."""
        spare = max(0, min(unmatched_allowed - self.exponent_mismatches, len(self.largest), self.matched))
        return self.matched - spare, self.mantissa_sum - sum(self.largest[:spare])


def split_proof(proof: bytes, settings: ProofSettings) -> list[bytes]:
    size = settings.chunk_bytes
    if len(proof) % size:
        raise ValueError(f"proof is {len(proof)} bytes, not a whole number of {size}-byte chunk proofs")
    return [proof[i:i + size] for i in range(0, len(proof), size)]


def compare(chunk_proofs: list[bytes], states: torch.Tensor, settings: ProofSettings) -> list[ChunkComparison]:
    """chunk_proofs[c] against recomputed states [chunks, chunk_tokens, hidden] (zero-padded past a
    shorter last chunk). Raises ValueError for a proof that is not a proof."""
    moduli, coefficients = (t.to(states.device) for t in encoding.unpack(chunk_proofs, settings.topk))
    positions, own = top_values(states, settings.topk)
    claimed = encoding.evaluate(coefficients, positions % moduli[:, None])
    magnitudes = states.reshape(states.shape[0], -1).to(torch.float32).abs().gather(-1, positions)
    cut = magnitudes.min(-1, keepdim=True).values
    at_cut = magnitudes - cut <= cut * TIE_RELATIVE
    sign_exponent_differs = ((claimed >> 10) != (own >> 10)) & ~at_cut
    mantissa = ((claimed & 0x3FF) - (own & 0x3FF)).abs().masked_fill(sign_exponent_differs | at_cut, 0)
    mismatches = sign_exponent_differs.sum(-1)
    matched = settings.topk - mismatches - at_cut.sum(-1)
    sums = mantissa.sum(-1)
    means = sums.to(torch.float64) / matched.clamp(min=1)
    largest = mantissa.topk(min(LARGEST_KEPT, settings.topk), dim=-1).values.tolist()
    return [ChunkComparison(int(mismatches[c]), float(means[c]), largest[c][0], int(matched[c]), int(sums[c]),
                            tuple(largest[c][:int(matched[c])]))
            for c in range(len(chunk_proofs))]
