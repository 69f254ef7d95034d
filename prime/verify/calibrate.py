"""Measures how far honest workers' rollouts deviate from the verifier's recomputation, and writes
thresholds with a margin next to the model (`<model>/toploc.json`), where the verifier reads them.

Honest variation comes from everything a worker may legitimately do differently from the verifier:
decoding with a KV cache (the verifier does one prefill), other batch sizes (other padding, other
kernels), other thread counts, and each compute dtype the run allows. Each combination generates
rollouts from its own prompts and seeds; every chunk is compared with a float32 prefill.

    python -m prime.verify.calibrate --model exported/policy
    python -m prime.verify.calibrate --model exported/policy --dtypes float32,bfloat16 --threads 1,2,4
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import logging
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from prime.inference.engine import GenerationRequest
from prime.inference.hf_engine import HFEngine, eos_id_of, load_hf_policy
from prime.inference.sampling import SamplingParams
from prime.verify.proof import ProofSettings, proof_observer
from prime.verify.thresholds import (
    Calibration,
    HonestMaxima,
    Limits,
    ToplocThresholds,
    logit_scale,
)
from prime.verify.verifier import Claim, recompute

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAMPLINGS = [SamplingParams(temperature=t, top_p=p) for t, p in ((1.0, 1.0), (0.7, 0.9), (1.0, 0.9), (0.0, 1.0))]


@dataclass(frozen=True)
class Condition:
    dtype: str
    threads: int
    batch_size: int

    def __str__(self) -> str:
        return f"{self.dtype}, {self.threads} threads, batch {self.batch_size}"


def corpus_prompts(tokenize, count: int, seed: int, shortest: int = 1, longest: int = 128) -> list[list[int]]:
    """Slices of the built-in corpus (the Python standard library's sources) of random lengths."""
    from prime.data.builtin_corpus import _documents

    documents = [text for _, text in _documents()]
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < count:
        text = rng.choice(documents)
        start = rng.randrange(max(1, len(text) - 4 * longest))
        tokens = tokenize(text[start:start + 4 * longest])[:rng.randint(shortest, longest)]
        if tokens:
            prompts.append(tokens)
    return prompts


def requests_for(prompts: list[list[int]], seed: int, max_tokens: int) -> list[GenerationRequest]:
    """Each prompt with its own seed and one of several sampling settings (greedy included)."""
    rng = random.Random(seed)
    return [GenerationRequest(prompt, seed=rng.getrandbits(63),
                              sampling=SAMPLINGS[i % len(SAMPLINGS)].model_copy(update={"max_tokens": max_tokens}))
            for i, prompt in enumerate(prompts)]


def generate_claims(model, requests: list[GenerationRequest], batch_size: int, threads: int,
                    proof: ProofSettings, record_logits: bool = False, eos_id: int | None = None) -> list[Claim]:
    """Honest rollouts, generated `batch_size` at a time on `threads` threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = HFEngine(model, eos_id=eos_id, observer=proof_observer(proof), pad_id=model.config.pad_token_id or 0,
                          record_logits=record_logits)
        claims = []
        for start in range(0, len(requests), batch_size):
            batch = requests[start:start + batch_size]
            claims += [Claim(r.prompt, r.seed, r.sampling, c) for r, c in zip(batch, engine.generate(batch))]
        return claims
    finally:
        torch.set_num_threads(previous)


def measure(reference, claims: list[Claim], proof: ProofSettings, verify_batch: int) -> HonestMaxima:
    """The largest deviation of these (honest) claims from a float32 recomputation, per statistic."""
    mismatches, chunk_mean, rollout_mean, logit, logprob, deviating, compared = 0, 0.0, 0.0, 0.0, 0.0, 0, 0
    for start in range(0, len(claims), verify_batch):
        batch = claims[start:start + verify_batch]
        for claim, (logits, chunks) in zip(batch, recompute(reference, batch, proof)):
            mismatches = max(mismatches, *(c.exponent_mismatches for c in chunks))
            chunk_mean = max(chunk_mean, *(c.mantissa_mean for c in chunks))
            rollout_mean = max(rollout_mean, sum(c.mantissa_sum for c in chunks) / max(1, sum(c.matched for c in chunks)))
            deviating, compared = deviating + sum(c.deviates for c in chunks), compared + len(chunks)
            completion, logits = claim.completion, logits.cpu()
            scale = logit_scale(logits)  # float32 rounding grows with the logits' magnitude
            logit = max(logit, float(((completion.logits - logits).abs() / scale[:, None]).max()))
            temperature = claim.sampling.temperature or 1.0
            recomputed = torch.log_softmax(logits / temperature, -1).gather(
                -1, torch.tensor(completion.tokens)[:, None])[:, 0]
            logprob = max(logprob, temperature * float(((torch.tensor(completion.logprobs) - recomputed).abs() / scale).max()))
    return HonestMaxima(exponent_mismatches=mismatches, mantissa_mean=chunk_mean, rollout_mantissa_mean=rollout_mean,
                        logit_noise=logit, logprob_noise=logprob, deviating_chunks=deviating / max(1, compared))


MIN_DEVIATION_RATE = 0.02


def limits_from(maxima: HonestMaxima, margin: float, proof: ProofSettings) -> Limits:
    """The margin multiplies every honest maximum; one quantum of each statistic is added on top, so a
    calibration that saw no deviation at all (common on CPU in float32) still tolerates the smallest one
    it could have seen: one more value with another exponent, one more ULP in a chunk, and float32
    rounding of the largest logit (noise is measured per unit of it)."""
    rounding = torch.finfo(torch.float32).eps
    return Limits(
        exponent_mismatches=math.ceil(margin * maxima.exponent_mismatches) + 1,
        mantissa_mean=margin * maxima.mantissa_mean + 1 / proof.topk,
        rollout_mantissa_mean=margin * maxima.rollout_mantissa_mean + 1 / proof.topk,
        logit_noise=margin * maxima.logit_noise + rounding,
        logprob_noise=margin * maxima.logprob_noise + 2 * rounding,
        # A share, not a maximum: the margin over the pooled share, and never under 2% (a calibration of a
        # few hundred rollouts that saw none still allows some).
        deviation_rate=min(1.0, max(margin * maxima.deviating_chunks, MIN_DEVIATION_RATE)),
    )


def calibrate(model_dir: Path, dtypes: list[str], threads: list[int], batch_sizes: list[int], rollouts: int,
              max_tokens: int, margin: float, seed: int, proof: ProofSettings, verify_batch: int = 8,
              device: str = "cpu") -> ToplocThresholds:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    reference = load_hf_policy(model_dir, torch.float32, device)
    eos_id_of(reference)  # fails early with a clear message if the model names no EOS
    conditions = [Condition(d, t, b) for d, t, b in itertools.product(dtypes, threads, batch_sizes)]
    measured: dict[str, list[HonestMaxima]] = {dtype: [] for dtype in dtypes}
    weights: dict[str, list[int]] = {dtype: [] for dtype in dtypes}  # chunks measured in each condition
    chunks = tokens = 0
    for index, condition in enumerate(tqdm(conditions, desc="calibrating", unit="condition")):
        worker = reference if condition.dtype == "float32" else load_hf_policy(model_dir, DTYPES[condition.dtype], device)
        prompts = corpus_prompts(lambda text: tokenizer.encode(text, add_special_tokens=False), rollouts,
                                 seed=seed * 1000 + index)
        claims = generate_claims(worker, requests_for(prompts, seed * 1000 + index, max_tokens),
                                 condition.batch_size, condition.threads, proof, record_logits=True)
        maxima = measure(reference, claims, proof, verify_batch)
        tqdm.write(f"{condition}: {len(claims)} rollouts, honest maxima {maxima.model_dump()}")
        measured[condition.dtype].append(maxima)
        weights[condition.dtype].append(sum(proof.chunks_for(len(c.completion.tokens)) for c in claims))
        chunks += weights[condition.dtype][-1]
        tokens += sum(len(c.completion.tokens) for c in claims)
    # The largest of each deviation; but the share of deviating chunks pooled over every condition: one
    # condition's share of a hundred chunks is mostly sampling noise, and the test it feeds
    # (prime/rl/orchestrator/evidence.py) compares a worker's share over hundreds.
    worst = {dtype: HonestMaxima(**{field: max(getattr(m, field) for m in runs) for field in HonestMaxima.model_fields
                                    if field != "deviating_chunks"},
                                 deviating_chunks=sum(m.deviating_chunks * n for m, n in zip(runs, weights[dtype]))
                                 / max(1, sum(weights[dtype])))
             for dtype, runs in measured.items()}
    record = Calibration(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), torch=torch.__version__,
        device=torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu", chunks=chunks, tokens=tokens,
        conditions=[str(c) for c in conditions] + [f"prompts of 1-128 tokens, completions up to {max_tokens}",
                                                   "sampling: " + ", ".join(f"T={s.temperature} top-p={s.top_p}" for s in SAMPLINGS)],
        margin=margin, honest_maxima=worst)
    return ToplocThresholds(proof=proof, calibration=record,
                            limits={dtype: limits_from(m, margin, proof) for dtype, m in worst.items()})


def _list(kind):
    def parse(text: str) -> list:
        try:
            values = [kind(part) for part in text.split(",") if part]
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{text!r}: {error}") from error
        if not values:
            raise argparse.ArgumentTypeError("give at least one value")
        return values
    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m prime.verify.calibrate",
        description="Measure honest TOPLOC variation on this machine and write thresholds to <model>/toploc.json.",
        epilog="example: python -m prime.verify.calibrate --model exported/policy --threads 1,2 --batch-sizes 1,4,16")
    parser.add_argument("--model", type=Path, required=True, help="a local Hugging Face causal-LM directory")
    parser.add_argument("--dtypes", type=_list(str), default=["float32"],
                        help="worker compute dtypes the run allows, comma-separated (default float32)")
    parser.add_argument("--threads", type=_list(int), default=[1, 2], help="thread counts (default 1,2)")
    parser.add_argument("--batch-sizes", type=_list(int), default=[1, 4, 16], help="generation batch sizes (default 1,4,16)")
    parser.add_argument("--rollouts", type=int, default=32, help="rollouts per condition (default 32)")
    parser.add_argument("--max-tokens", type=int, default=96, help="completion length limit (default 96)")
    parser.add_argument("--margin", type=float, default=2.0, help="factor on every honest maximum (default 2)")
    parser.add_argument("--chunk-tokens", type=int, default=32, help="tokens per chunk proof (default 32)")
    parser.add_argument("--topk", type=int, default=128, help="activations per chunk proof (default 128)")
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts and sampling seeds (default 0)")
    parser.add_argument("--device", default="cpu", help="where workers and the reference run: cpu or cuda "
                        "(the verifier must then run there too; default cpu)")
    args = parser.parse_args(argv)
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"--dtypes {unknown}: choose from {sorted(DTYPES)}")
    if min(args.threads) < 1 or min(args.batch_sizes) < 1 or args.rollouts < 1 or args.max_tokens < 1:
        parser.error("--threads, --batch-sizes, --rollouts and --max-tokens must be positive")
    if args.margin <= 1:
        parser.error(f"--margin {args.margin} must be above 1")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        thresholds = calibrate(args.model, args.dtypes, args.threads, args.batch_sizes, args.rollouts,
                               args.max_tokens, args.margin, args.seed,
                               ProofSettings(chunk_tokens=args.chunk_tokens, topk=args.topk), device=args.device)
    except (FileNotFoundError, ValueError) as error:
        print(f"calibrate: {error}", file=sys.stderr)
        return 2
    path = thresholds.save(args.model)
    print(f"calibrate: {thresholds.calibration.chunks} honest chunks over {len(thresholds.calibration.conditions) - 2} "
          f"conditions; thresholds written to {path}")
    for dtype, limits in thresholds.limits.items():
        maxima = thresholds.calibration.honest_maxima[dtype]
        print(f"  {dtype} workers: honest maxima {maxima.model_dump()}")
        print(f"  {dtype} limits: exponent mismatches {limits.exponent_mismatches}, mantissa mean "
              f"{limits.mantissa_mean:.4g} (rollout {limits.rollout_mantissa_mean:.4g}), logit noise "
              f"{limits.logit_noise:.3g}, logprob noise {limits.logprob_noise:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
