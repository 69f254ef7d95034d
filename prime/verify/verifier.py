"""Checks a worker's rollout against one prefill pass of the claimed model version.

Named outcomes, in the order they are checked:
- format: the claim is well-formed (token ids, lengths, proof size, finite logprobs).
- termination: it ends at the length limit, or at an EOS that the seed's sampler picks there.
- activations: each chunk's TOPLOC proof matches the recomputed final hidden states within the
  calibrated thresholds (another model, quantized or stale weights, another precision fail here).
- sampling: every other token is the seed's pick from the recomputed logits under the claimed temperature
  and top-p, up to a score gap that the calibrated logit noise allows.
- logprobs: the reported logprobs equal the recomputed ones within the calibrated noise.
A rollout is accepted only if all pass; every failed check says where and by how much.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
from transformers import PreTrainedModel

from prime.inference import sampling
from prime.inference.engine import Completion
from prime.verify.proof import ChunkComparison, ProofSettings, compare, split_proof
from prime.verify.thresholds import Limits, ToplocThresholds, logit_scale

CHECKS = ("format", "termination", "activations", "sampling", "logprobs")


@dataclass(frozen=True)
class Claim:
    """A rollout to verify: what the orchestrator assigned (prompt, seed, sampling) and what the worker returned."""

    prompt: list[int]
    seed: int
    sampling: sampling.SamplingParams
    completion: Completion


@dataclass
class Check:
    name: str
    passed: bool
    detail: str = ""


@dataclass
class Verdict:
    checks: list[Check]
    chunks: list[ChunkComparison] = field(default_factory=list)

    @property
    def accepted(self) -> bool:
        return all(check.passed for check in self.checks)

    @property
    def rejected_by(self) -> list[str]:
        return [check.name for check in self.checks if not check.passed]

    @property
    def reason(self) -> str:
        failed = [f"{check.name}: {check.detail}" for check in self.checks if not check.passed]
        return "; ".join(failed) if failed else "accepted"


@dataclass(frozen=True)
class TokenChecks:
    """Per completion token of one claim: its score's gap below the seed's pick and the tolerance of
    that gap, whether it lies outside every nucleus the noise allows, and its reported logprob's error
    against the recomputed one (as a multiple of its tolerance, and whether over it)."""

    gaps: list[float]
    outside: list[bool]
    score_tolerance: list[float]
    logprob_ratio: list[float]
    logprob_over: list[bool]
    recomputed: list[float]
    logprob_tolerance: list[float]


class Verifier:
    """Holds the claimed version's model (computing in float32) and its calibrated thresholds."""

    def __init__(self, model: PreTrainedModel, thresholds: ToplocThresholds, eos_id: int, batch_size: int = 8) -> None:
        if next(model.parameters()).dtype != torch.float32:
            raise ValueError("the verifier recomputes in float32, the precision the thresholds were measured against")
        self.model = model.eval()
        self.thresholds = thresholds
        self.eos_id = eos_id
        self.batch_size = batch_size

    def verify(self, claims: Sequence[Claim]) -> list[Verdict]:
        verdicts: list[Verdict | None] = [None] * len(claims)
        well_formed = []
        for i, claim in enumerate(claims):
            problem = self._format_problem(claim)
            if problem:
                verdicts[i] = Verdict([Check("format", False, problem)])
            else:
                well_formed.append(i)
        # Similar lengths share a batch: less padding to compute through.
        well_formed.sort(key=lambda i: len(claims[i].prompt) + len(claims[i].completion.tokens))
        for start in range(0, len(well_formed), self.batch_size):
            batch = well_formed[start:start + self.batch_size]
            for i, verdict in zip(batch, self._verify_batch([claims[i] for i in batch])):
                verdicts[i] = verdict
        return verdicts  # type: ignore[return-value]

    def _format_problem(self, claim: Claim) -> str:
        completion, vocab = claim.completion, self.model.config.vocab_size
        tokens, settings = completion.tokens, self.thresholds.proof
        if not claim.prompt:
            return "empty prompt (nothing to condition on; the orchestrator refuses such tasks)"
        if not tokens:
            return "empty completion"
        if len(tokens) > claim.sampling.max_tokens:
            return f"{len(tokens)} tokens, more than the limit {claim.sampling.max_tokens}"
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in tokens):
            return f"a token id outside the vocabulary [0, {vocab})"
        if len(claim.prompt) + len(tokens) > self.model.config.max_position_embeddings:
            return "prompt and completion are longer than the model's context"
        if len(completion.logprobs) != len(tokens) or not all(math.isfinite(x) and x <= 0 for x in completion.logprobs):
            return f"{len(completion.logprobs)} logprobs for {len(tokens)} tokens, or one not finite and ≤ 0"
        if self.eos_id in tokens[:-1]:
            return f"EOS at token {tokens.index(self.eos_id)} with tokens after it"
        ends_with_eos = tokens[-1] == self.eos_id
        if completion.finish_reason != ("eos" if ends_with_eos else "length"):
            return f"finish reason {completion.finish_reason!r} does not match the tokens"
        expected = settings.chunks_for(len(tokens)) * settings.chunk_bytes
        if len(completion.proof) != expected:
            return f"proof is {len(completion.proof)} bytes; {len(tokens)} tokens need {expected}"
        if completion.compute_dtype not in self.thresholds.limits:
            return (f"compute dtype {completion.compute_dtype!r} is not one this run allows "
                    f"(calibrated: {', '.join(self.thresholds.limits)})")
        return ""

    def _verify_batch(self, claims: list[Claim]) -> list[Verdict]:
        try:
            recomputed = recompute(self.model, claims, self.thresholds.proof)
        except ValueError as error:  # a proof that is not a proof: field residues out of range
            return [Verdict([Check("format", False, f"unreadable proof ({error})")]) for _ in claims]
        logits = [rows for rows, _ in recomputed]
        tokens = self._token_checks(claims, logits)
        return [self._judge(claim, rows, chunks, checks)
                for claim, rows, (_, chunks), checks in zip(claims, logits, recomputed, tokens)]

    def _token_checks(self, claims: list[Claim], logits: list[torch.Tensor]) -> list[TokenChecks]:
        """The per-token numbers of every claim, computed over all claims that share sampling settings and
        compute dtype at once: claim by claim they were some sixty small tensor operations each, and 38% of
        the orchestrator's CPU time (py-spy, rl_async at async 2) against 20% for the prefill itself."""
        out: list[TokenChecks | None] = [None] * len(claims)
        groups: dict[tuple, list[int]] = {}
        for i, claim in enumerate(claims):
            groups.setdefault((claim.sampling, claim.completion.compute_dtype), []).append(i)
        for (params, dtype), members in groups.items():
            t = self.thresholds.limits[dtype]
            rows = torch.cat([logits[i] for i in members])
            device = rows.device
            lengths = [len(claims[i].completion.tokens) for i in members]
            tokens = torch.tensor([x for i in members for x in claims[i].completion.tokens], device=device)
            seeds = torch.tensor([claims[i].seed for i, n in zip(members, lengths) for _ in range(n)], device=device)
            positions = torch.cat([torch.arange(n, device=device) for n in lengths])
            temperature = params.temperature or 1.0
            scale = logit_scale(rows)  # per position: honest rounding grows with the logits' magnitude
            score_tolerance = 2 * t.logit_noise * scale / temperature
            gaps, outside = self._sampling_gaps(rows, tokens, seeds, positions, params, score_tolerance)
            recomputed = sampling.logprobs(rows, tokens, params)
            reported = torch.tensor([x for i in members for x in claims[i].completion.logprobs], device=device)
            error = (reported - recomputed).abs()
            tolerance = t.logprob_noise * scale / temperature
            columns = [gaps, outside, score_tolerance.tolist(), (error / tolerance).tolist(),
                       (error > tolerance).tolist(), recomputed.tolist(), tolerance.tolist()]
            start = 0
            for i, n in zip(members, lengths):
                out[i] = TokenChecks(*(column[start:start + n] for column in columns))
                start += n
        return out  # type: ignore[return-value]

    def _judge(self, claim: Claim, logits: torch.Tensor, chunks: list[ChunkComparison], c: TokenChecks) -> Verdict:
        completion, params = claim.completion, claim.sampling
        t = self.thresholds.limits[completion.compute_dtype]
        temperature = params.temperature or 1.0
        n = len(completion.tokens)
        bad = [j for j in range(n) if c.outside[j] or c.gaps[j] > c.score_tolerance[j]]
        ends_with_eos = completion.finish_reason == "eos"
        checks = []
        if ends_with_eos and bad and bad[-1] == n - 1:
            j = bad.pop()
            eos_probability = float(torch.softmax(logits[j] / temperature, -1)[self.eos_id])
            checks.append(Check("termination", False, f"ends with EOS at token {j}, where the model gives EOS "
                                f"probability {eos_probability:.2g} and the seed picks token "
                                f"{self._pick(logits[j], claim.seed, j, params)}"))
        elif not ends_with_eos and n != params.max_tokens:
            checks.append(Check("termination", False, f"stops after {n} tokens without EOS, "
                                f"before the limit {params.max_tokens}"))
        else:
            checks.append(Check("termination", True))

        checks.append(activation_check(chunks, t, self.thresholds.proof))

        if bad:
            j = bad[0]
            what = (f"outside the top-p {params.top_p} nucleus" if c.outside[j]
                    else f"{c.gaps[j]:.3g} below the seed's pick (tolerance {c.score_tolerance[j]:.2g})")
            checks.append(Check("sampling", False, f"{len(bad)} of {n} tokens are not the seed's picks "
                                f"at temperature {params.temperature}, top-p {params.top_p}; first at token {j} "
                                f"(id {completion.tokens[j]}): {what}"))
        else:
            checks.append(Check("sampling", True))

        worst = max(range(n), key=lambda j: c.logprob_ratio[j])
        if c.logprob_over[worst]:
            checks.append(Check("logprobs", False, f"{sum(c.logprob_over)} reported logprobs differ from "
                                f"the recomputed ones; worst at token {worst}: {completion.logprobs[worst]:.7f} "
                                f"against {c.recomputed[worst]:.7f} (tolerance {c.logprob_tolerance[worst]:.2g})"))
        else:
            checks.append(Check("logprobs", True))
        return Verdict(checks, chunks)

    @staticmethod
    def _pick(logits: torch.Tensor, seed: int, position: int, params: sampling.SamplingParams) -> int:
        seeds, positions = torch.tensor([seed], device=logits.device), torch.tensor([position], device=logits.device)
        return int(sampling.sample(logits[None], seeds, positions, params)[0])

    @staticmethod
    def _sampling_gaps(logits: torch.Tensor, tokens: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                       params: sampling.SamplingParams, score_tolerance: torch.Tensor) -> tuple[list[float], list[bool]]:
        """Per token (row): how far its score lies below the best score among tokens that are in the nucleus
        however the logits' noise falls, and whether it lies outside every nucleus that noise allows. seeds,
        positions: the row's claim's seed and the token's position in its completion."""
        unrestricted = params.model_copy(update={"top_p": 1.0})
        score = sampling.scores(logits, seeds, positions, unrestricted)
        if params.temperature > 0 and params.top_p < 1.0:
            # A probability moves by at most a factor exp(score_tolerance) when every logit moves by δ.
            above = sampling.nucleus_mass_above(torch.softmax(logits.double() / params.temperature, -1))
            factor = torch.exp(score_tolerance.double())[:, None]
            surely_in = above * factor < params.top_p
            maybe_in = above / factor < params.top_p
        else:
            surely_in = maybe_in = torch.ones_like(score, dtype=torch.bool)
        best = score.masked_fill(~surely_in, float("-inf")).max(-1).values
        claimed = score.gather(-1, tokens[:, None])[:, 0]
        gaps = (best - claimed).clamp(min=0).tolist()
        outside = (~maybe_in.gather(-1, tokens[:, None])[:, 0]).tolist()
        return gaps, outside


@torch.no_grad()
def recompute(model: PreTrainedModel, claims: Sequence[Claim], settings: ProofSettings) -> list[tuple[torch.Tensor, list[ChunkComparison]]]:
    """One prefill pass over well-formed claims: per claim, the logits that chose each completion
    token ([tokens, vocab], float32) and each chunk proof compared with the recomputed states."""
    sequences = [c.prompt + c.completion.tokens for c in claims]
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(claims), width, dtype=torch.int64)
    for row, sequence in enumerate(sequences):
        ids[row, :len(sequence)] = torch.tensor(sequence)
    device = next(model.parameters()).device
    # Right padding under causal attention: no real position ever sees a pad, so no mask is needed,
    # and without one attention takes its fused causal kernel.
    hidden = model.model(input_ids=ids.to(device)).last_hidden_state
    # The state at position p predicts token p + 1: a completion's token j comes from prompt_len - 1 + j.
    states = [hidden[row, len(c.prompt) - 1:len(c.prompt) - 1 + len(c.completion.tokens)]
              for row, c in enumerate(claims)]
    chunk_states, owners = [], []
    for row, state in enumerate(states):
        count = settings.chunks_for(len(state))
        padded = torch.zeros(count * settings.chunk_tokens, state.shape[1], device=state.device)
        padded[:len(state)] = state
        chunk_states.append(padded.view(count, settings.chunk_tokens, -1))
        owners += [row] * count
    chunk_proofs = [proof for c in claims for proof in split_proof(c.completion.proof, settings)]
    comparisons = compare(chunk_proofs, torch.cat(chunk_states), settings)
    return [(model.lm_head(state).float(), [c for c, owner in zip(comparisons, owners) if owner == row])
            for row, state in enumerate(states)]


def activation_check(chunks: list[ChunkComparison], t: Limits, settings: ProofSettings) -> Check:
    """A rollout's chunk comparisons against the limits of the dtype its worker claimed. Up to
    t.exponent_mismatches positions per chunk may lie outside the prover's top k (a near-tie at the k-th
    magnitude); the mantissa means are taken over the rest (ChunkComparison.trimmed)."""
    matched_total, sum_total = 0, 0
    for index, chunk in enumerate(chunks):
        tokens = f"tokens {index * settings.chunk_tokens}–{(index + 1) * settings.chunk_tokens - 1}"
        if chunk.exponent_mismatches > t.exponent_mismatches:
            return Check("activations", False, f"chunk {index} ({tokens}): {chunk.exponent_mismatches} of "
                         f"{settings.topk} top-k values differ in sign or exponent (threshold {t.exponent_mismatches})")
        matched, total = chunk.trimmed(t.exponent_mismatches)
        mean = total / max(matched, 1)
        if mean > t.mantissa_mean:
            return Check("activations", False, f"chunk {index} ({tokens}): mean mantissa difference {mean:.3g} "
                         f"ULP over {matched} positions (threshold {t.mantissa_mean:.3g}; largest differences "
                         f"{', '.join(map(str, chunk.largest[:4]))})")
        matched_total, sum_total = matched_total + matched, sum_total + total
    overall = sum_total / max(matched_total, 1)
    if overall > t.rollout_mantissa_mean:
        return Check("activations", False, f"mean mantissa difference over the rollout {overall:.3g} ULP "
                     f"(threshold {t.rollout_mantissa_mean:.3g})")
    return Check("activations", True)
