"""TOPLOC: proofs built during generation, verification with named outcomes, thresholds from the
calibration command, the attack suite, and the honest side (no false rejects over 1000+ chunks).

All real: a trained byte-level Llama (prime.testing.tiny_policy, built once per machine), the real
engine with its KV cache, real calibration. Nothing is mocked.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import replace

import pytest
import torch

from prime.data.tokenizer import ByteTokenizer
from prime.inference.engine import GenerationRequest
from prime.inference.hf_engine import HFEngine, load_hf_policy
from prime.inference.sampling import SamplingParams, uniforms
from prime.testing.tiny_policy import next_version, tiny_policy_dir
from prime.testing.toploc_attacks import ATTACKS, AttackContext, honest_claims
from prime.verify import calibrate, encoding
from prime.verify.calibrate import corpus_prompts, generate_claims
from prime.verify.proof import (
    ChunkComparison,
    ProofSettings,
    compare,
    encode,
    proof_observer,
    top_values,
)
from prime.verify.thresholds import Limits, ToplocThresholds
from prime.verify.verifier import Verifier, activation_check

EOS = ByteTokenizer().eos_id
ATTACK_SAMPLING = SamplingParams(temperature=1.0, top_p=0.8, max_tokens=96)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """A copy of the tiny policy (version v-1), calibrated by the real command with a small budget."""
    source = tiny_policy_dir()
    directory = tmp_path_factory.mktemp("toploc") / "policy"
    shutil.copytree(source, directory)
    assert calibrate.main(["--model", str(directory), "--rollouts", "8", "--threads", "1,2",
                           "--batch-sizes", "1,8", "--max-tokens", "96"]) == 0
    return directory


@pytest.fixture(scope="module")
def versions(policy):
    """(v, v-1): the claimed version is one AdamW step (lr 1e-5) after the calibrated one."""
    previous = load_hf_policy(policy)
    return next_version(previous, lr=1e-5), previous


@pytest.fixture(scope="module")
def verifier(policy, versions):
    return Verifier(versions[0], ToplocThresholds.load(policy), eos_id=EOS)


def test_polynomial_encoding_round_trips_in_258_bytes():
    generator = torch.Generator().manual_seed(0)
    for span in (4096, 300_000):  # the second needs moduli below P for some rows
        positions = torch.stack([torch.randperm(span, generator=generator)[:128] for _ in range(6)])
        values = torch.randint(0, encoding.P, (6, 128), generator=generator)
        moduli = encoding.pick_modulus(positions)
        reduced = positions % moduli[:, None]
        assert all(len(torch.unique(row)) == 128 for row in reduced)
        packed = encoding.pack(moduli, encoding.interpolate(reduced, values))
        assert {len(p) for p in packed} == {258}
        read_moduli, coefficients = encoding.unpack(packed, 128)
        assert torch.equal(encoding.evaluate(coefficients, positions % read_moduli[:, None]), values)
    with pytest.raises(ValueError, match="258 bytes"):
        encoding.unpack([b"\x00" * 257], 128)
    with pytest.raises(ValueError, match="outside the field"):
        encoding.unpack([b"\xff" * 258], 128)


def test_a_near_tie_at_the_kth_magnitude_does_not_reject_an_honest_chunk():
    """Prover and verifier order a near-tie at the k-th largest magnitude the other way round: the
    verifier reads the proof at a position the prover never committed to. Mostly that value's exponent
    differs (one such position per chunk is allowed); where it agrees by chance, its mantissa difference
    is noise of hundreds of ULPs, and that one position's noise evicted an honest float32 worker
    (rl_async, 2026-12-06: 0.625 ULP mean in one chunk, its logits and logprobs exact)."""
    settings = ProofSettings()
    limits = Limits(exponent_mismatches=1, mantissa_mean=0.133, rollout_mantissa_mean=0.133, logit_noise=1e-5,
                    logprob_noise=1e-5)  # what calibration gives a float32 CPU worker
    generator = torch.Generator().manual_seed(0)
    states = torch.zeros(1000, 32, 128)
    states[:, :5] = torch.randn(1000, 5, 128, generator=generator)  # 5 tokens: 640 values for 128 places
    positions, bits = top_values(states, settings.topk)
    proofs = encode(positions, bits)
    flat = states.reshape(1000, -1).clone()
    order = flat.abs().argsort(dim=-1, descending=True)
    inside, outside = order[:, settings.topk - 1:settings.topk], order[:, settings.topk:settings.topk + 1]
    nudged = flat.gather(1, inside).abs() * (1 + 1e-6) * flat.gather(1, outside).sign()
    flat.scatter_(1, outside, nudged)  # now just above the k-th: in the verifier's top k, not the prover's
    chunks = compare(proofs, flat.view(1000, 32, 128), settings)
    # It is the verifier's k-th now, at the cut: not compared (before TIE_RELATIVE: one mismatch in ~49 of
    # 50 chunks, and in 11 of 1000 an exponent agreeing by chance with noise in its mantissa).
    assert all(c.exponent_mismatches == 0 and settings.topk - 2 <= c.matched < settings.topk for c in chunks)
    assert all(activation_check([c], limits, settings).passed for c in chunks)
    # Only as many positions as the threshold allows are set aside: two noisy ones, or a 1-ULP shift at
    # every position (another version of the weights), still fail.
    two = ChunkComparison(0, 900 / 128, 500, 128, 900, (500, 400, 0))
    shifted = ChunkComparison(0, 1.0, 1, 128, 128, (1,) * 8)
    for chunk in (two, shifted):
        check = activation_check([chunk], limits, settings)
        assert not check.passed and "mean mantissa difference" in check.detail
    assert "largest differences 500, 400" in activation_check([two], limits, settings).detail


def test_a_cut_inside_a_run_of_near_equal_values_is_not_a_mismatch():
    """Issue 51's repro: one hidden dimension saturates after the final norm, 7 values sit within 3e-7 of
    each other at the top-k cut, and honest noise (cached decoding against the verifier's prefill) swaps
    two pairs across it: 2 exponent mismatches against a float32 limit of 1 evicted an honest worker. Values
    at the cut are not compared now; a changed value above the cut still is."""
    settings = ProofSettings(chunk_tokens=4, topk=16)
    limits = Limits(exponent_mismatches=1, mantissa_mean=0.133, rollout_mantissa_mean=0.133, logit_noise=1e-5,
                    logprob_noise=1e-5)
    generator = torch.Generator().manual_seed(3)
    prover = torch.randn(1, 4, 32, generator=generator)  # 128 values for 16 places
    flat = prover.view(-1)
    order = flat.abs().argsort(descending=True)
    top = float(flat[order[12]].abs())  # places 13..19 (the cut is at 16): a saturated run, 3e-7 apart
    for j, position in enumerate(order[12:19].tolist()):
        flat[position] = (top - 1e-3 - j * 3e-7) * (1 if flat[position] >= 0 else -1)
    proofs = encode(*top_values(prover, settings.topk))
    verifier = prover.clone().view(-1)
    run = order[12:19].tolist()
    for inside, outside in ((run[3], run[4]), (run[2], run[5])):  # two pairs swap across the cut
        verifier[inside], verifier[outside] = verifier[outside].clone(), verifier[inside].clone()
    verifier[run[4]] *= 1 + 1e-7  # a one-bit difference keeps the swapped order strict
    [chunk] = compare(proofs, verifier.view(1, 4, 32), settings)
    assert chunk.exponent_mismatches == 0 and activation_check([chunk], limits, settings).passed, chunk
    # Without the rule the same chunk shows what evicted the worker:
    positions_v = top_values(verifier.view(1, 4, 32), settings.topk)[0][0].tolist()
    positions_p = top_values(prover, settings.topk)[0][0].tolist()
    assert len(set(positions_v) - set(positions_p)) == 2
    # A value above the cut changed by far more than noise is still caught.
    cheated = verifier.clone()
    cheated[order[:2]] *= 1.5  # two places: one is what the limit allows outside the prover's set
    [caught] = compare(proofs, cheated.view(1, 4, 32), settings)
    assert caught.exponent_mismatches + (caught.mantissa_max > 0) >= 1
    assert not activation_check([caught], limits, settings).passed


def test_sampler_noise_depends_only_on_seed_position_and_token():
    # Pinned values: a platform or refactor that changed them would make honest workers fail.
    pinned = uniforms(torch.tensor([7]), torch.tensor([0]), 4)[0].tolist()
    assert pinned == pytest.approx([0.7385396, 0.2961744, 0.3759782, 0.2796082], abs=1e-6)
    # the same row drawn inside another batch, at another place, gets the same noise
    batch = uniforms(torch.tensor([1, 7, 9]), torch.tensor([3, 0, 1]), 4)
    assert torch.equal(batch[1], uniforms(torch.tensor([7]), torch.tensor([0]), 4)[0])


def test_generation_builds_one_chunk_proof_per_32_tokens_and_ignores_batching(versions):
    model = versions[0]
    prompts = corpus_prompts(ByteTokenizer().encode, 5, seed=3)
    requests = [GenerationRequest(p, seed=100 + i, sampling=SamplingParams(max_tokens=70)) for i, p in enumerate(prompts)]
    engine = HFEngine(model, eos_id=EOS, observer=proof_observer(ProofSettings()))
    together = engine.generate(requests)
    alone = [engine.generate([r])[0] for r in requests]
    for a, b in zip(together, alone):
        assert a.tokens == b.tokens  # seeded sampling: the batch a rollout was generated in does not matter
        assert len(a.proof) == ProofSettings().chunks_for(len(a.tokens)) * 258
        assert len(a.logprobs) == len(a.tokens)
    assert engine.stats.proof_s > 0 and engine.stats.tokens == 2 * sum(len(c.tokens) for c in together)


def test_calibration_writes_thresholds_next_to_the_model(policy, tmp_path):
    thresholds = ToplocThresholds.load(policy)
    assert list(thresholds.limits) == ["float32"]  # the command's default: float32 workers only
    maxima, limits = thresholds.calibration.honest_maxima["float32"], thresholds.limits["float32"]
    assert thresholds.calibration.chunks >= 20 and len(thresholds.calibration.conditions) == 4 + 2
    assert limits.exponent_mismatches > maxima.exponent_mismatches
    assert limits.mantissa_mean > maxima.mantissa_mean
    assert limits.logit_noise > maxima.logit_noise > 0  # KV-cache decoding never equals prefill exactly
    with pytest.raises(FileNotFoundError, match="prime.verify.calibrate --model"):
        ToplocThresholds.load(tmp_path)
    (tmp_path / "toploc.json").write_text('{"proof": {"topk": 3}}')
    with pytest.raises(ValueError, match="not a valid thresholds file"):
        ToplocThresholds.load(tmp_path)


def test_no_honest_rollout_is_rejected_over_1000_chunks(versions, verifier):
    """Varied generation batch sizes, thread counts, prompt lengths, sampling settings and verifier
    batch sizes; prompts and seeds the calibration never saw."""
    model = versions[0]
    claims = honest_claims(model, ByteTokenizer().encode, verifier.thresholds.proof, EOS)
    chunks = sum(verifier.thresholds.proof.chunks_for(len(c.completion.tokens)) for c in claims)
    assert chunks >= 1000
    verdicts = []
    for start, size in ((0, 1), (1, 7), (8, 16)):
        verifier.batch_size = size
        verdicts += verifier.verify(claims[start:start + 100 if size > 1 else start + 1])
    verifier.batch_size = 8
    verdicts += verifier.verify(claims[len(verdicts):])
    rejected = [v.reason for v in verdicts if not v.accepted]
    assert not rejected, f"{len(rejected)} honest rollouts rejected over {chunks} chunks: {rejected[:3]}"
    assert any(c.completion.finish_reason == "eos" for c in claims)  # honest EOS endings are checked too


@pytest.fixture(scope="module")
def attack_context(policy, versions, verifier):
    model, previous = versions
    prompts = corpus_prompts(ByteTokenizer().encode, 12, seed=77)
    requests = [GenerationRequest(p, seed=9000 + i, sampling=ATTACK_SAMPLING) for i, p in enumerate(prompts)]
    honest = generate_claims(model, requests, 12, 1, verifier.thresholds.proof, eos_id=EOS)
    assert all(v.accepted for v in verifier.verify(honest))
    return AttackContext(model, previous, honest, verifier.thresholds.proof, EOS)


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_attack_is_rejected_with_a_reason_that_names_it(attack, attack_context, verifier):
    forged = attack.forge(attack_context)
    assert len(forged) >= 8
    for claim, verdict in zip(forged, verifier.verify(forged)):
        assert not verdict.accepted
        assert attack.expected_check in verdict.rejected_by, verdict.reason


def test_claims_verified_together_get_the_verdicts_they_get_alone(attack_context, verifier):
    """The per-token checks run over every claim of a batch at once (Verifier._token_checks): honest and
    forged claims of several sampling settings, interleaved in one call, must each get the verdict, and the
    reason, that they get verified one by one."""
    by_name = {a.name: a for a in ATTACKS}
    forged = [claim for name in ("one token edited (proof rebuilt)", "fabricated logprobs (+0.01)",
                                 "another temperature (1.3 for 1.0)", "cut short with a faked EOS (proof rebuilt)")
              for claim in by_name[name].forge(attack_context)[:2]]
    honest = attack_context.honest[:8]
    greedy = [replace(c, sampling=c.sampling.model_copy(update={"temperature": 0.0})) for c in honest[:2]]
    mixed = [claim for pair in zip(honest, forged) for claim in pair] + greedy
    together = verifier.verify(mixed)
    alone = [verifier.verify([claim])[0] for claim in mixed]
    assert [v.reason for v in together] == [v.reason for v in alone]
    assert [v.accepted for v in together[:16]] == [True, False] * 8
    assert not any(v.accepted for v in together[16:])  # sampled at temperature 1, claimed greedy


def test_malformed_claims_get_a_format_verdict(attack_context, verifier):
    honest = attack_context.honest[0]
    completion = honest.completion
    broken = {
        "random proof bytes": replace(completion, proof=bytes(random.Random(1).randrange(256) for _ in completion.proof)),
        "short proof": replace(completion, proof=completion.proof[:-1]),
        "token outside the vocabulary": replace(completion, tokens=[10_000] + completion.tokens[1:]),
        "EOS in the middle": replace(completion, tokens=[EOS] + completion.tokens[1:]),
        "non-finite logprob": replace(completion, logprobs=[float("nan")] + completion.logprobs[1:]),
        "over the length limit": replace(completion, tokens=completion.tokens * 2, logprobs=completion.logprobs * 2),
        "a compute dtype the run does not allow": replace(completion, compute_dtype="bfloat16"),
    }
    verdicts = verifier.verify([replace(honest, completion=c) for c in broken.values()])
    for what, verdict in zip(broken, verdicts):
        assert verdict.rejected_by[0] in ("format", "activations"), (what, verdict.reason)
        if what != "random proof bytes":  # random bytes may decode to residues: then they are a wrong proof
            assert verdict.rejected_by == ["format"], (what, verdict.reason)
