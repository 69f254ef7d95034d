"""Batched generation on Hugging Face transformers with a KV cache, seeded sampling and TOPLOC proofs.

Prompts of one batch are left-padded (positions counted from each prompt's first real token), then the
loop decodes one token per step for every row until each has met EOS or its length limit. Each step's
final hidden state goes to the batch's observer (a TOPLOC proof builder, where one is given) before
the next step; what the observer commits to is asked once, at the end of the batch.
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path
from typing import Sequence

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from prime.inference import sampling
from prime.inference.engine import Completion, GenerationRequest, GenerationStats, ObserverFactory


def load_hf_policy(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> PreTrainedModel:
    """A local HF causal-LM directory (a DiLoCo export or any other); nothing is downloaded."""
    location = Path(path)
    if not (location / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    # transformers renamed torch_dtype to dtype (4.56); pyproject allows versions on both sides.
    dtype_argument = "dtype" if _transformers_version() >= (4, 56) else "torch_dtype"
    transformers.utils.logging.disable_progress_bar()  # a bar per load drowns a worker's log lines
    model = AutoModelForCausalLM.from_pretrained(location, attn_implementation="sdpa", local_files_only=True,
                                                 **{dtype_argument: dtype})
    return model.to(device).eval()


def _transformers_version() -> tuple[int, int]:
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int(minor)


def eos_id_of(model: PreTrainedModel) -> int:
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos = eos if eos is not None else model.config.eos_token_id
    if isinstance(eos, list):
        eos = eos[0]
    if eos is None:
        raise ValueError("the model names no eos_token_id; pass eos_id explicitly")
    return int(eos)


def _cache_argument(model: PreTrainedModel) -> str:
    """transformers 5.x renamed `past_key_values` to `cache`; pyproject allows both sides of that."""
    return "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"


class HFEngine:
    """Implements `InferenceEngine` on a transformers causal LM (Llama-shaped: `.model` and `.lm_head`)."""

    def __init__(self, model: PreTrainedModel, eos_id: int | None = None, pad_id: int = 0,
                 observer: ObserverFactory | None = None, record_logits: bool = False) -> None:
        """observer: makes what watches each batch's hidden states (prime.verify.proof.proof_observer);
        None: no proofs (empty bytes)."""
        self.model = model.eval()
        self.eos_id = eos_id_of(model) if eos_id is None else eos_id
        self.pad_id = pad_id
        self.observer = observer
        self.record_logits = record_logits
        self.stats = GenerationStats()
        self._cache_argument = _cache_argument(model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        if missing or unexpected:
            raise ValueError(f"weights do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        """Completions in request order; requests with the same sampling settings share a batch."""
        results: list[Completion | None] = [None] * len(requests)
        groups: dict[sampling.SamplingParams, list[int]] = {}
        for i, request in enumerate(requests):
            if not request.prompt:
                raise ValueError(f"request {i} has an empty prompt")
            groups.setdefault(request.sampling, []).append(i)
        for params, members in groups.items():
            for i, completion in zip(members, self._generate_batch([requests[i] for i in members], params)):
                results[i] = completion
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def _generate_batch(self, requests: list[GenerationRequest], params: sampling.SamplingParams) -> list[Completion]:
        started = time.perf_counter()
        device, rows = self.device, len(requests)
        width = max(len(r.prompt) for r in requests)
        ids = torch.full((rows, width), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((rows, width), dtype=torch.int64)
        for row, request in enumerate(requests):
            ids[row, width - len(request.prompt):] = torch.tensor(request.prompt)
            mask[row, width - len(request.prompt):] = 1
        ids, mask = ids.to(device), mask.to(device)
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        seeds = torch.tensor([r.seed for r in requests], dtype=torch.int64, device=device)
        limit = torch.tensor([r.sampling.max_tokens for r in requests], device=device)
        builder = self.observer(rows, self.model.config.hidden_size, device) if self.observer else None
        cache = {self._cache_argument: DynamicCache()}
        hidden = self.model.model(input_ids=ids, attention_mask=mask, position_ids=position,
                                  use_cache=True, **cache).last_hidden_state[:, -1]
        active = torch.ones(rows, dtype=torch.bool, device=device)
        tokens, logprobs, logits_kept = [], [], []
        proof_s = 0.0
        step = 0
        while True:
            if not bool(torch.isfinite(hidden[active]).all()):
                raise FloatingPointError(f"the model produced non-finite activations at step {step}")
            if builder is not None:
                proof_started = time.perf_counter()
                builder.add(hidden, active)
                proof_s += time.perf_counter() - proof_started
            logits = self.model.lm_head(hidden).to(torch.float32)
            token = sampling.sample(logits, seeds, torch.full_like(seeds, step), params)
            token = token.masked_fill(~active, self.pad_id)
            tokens.append(token)
            logprobs.append(sampling.logprobs(logits, token, params))
            if self.record_logits:
                logits_kept.append(logits)
            step += 1
            active = active & (token != self.eos_id) & (step < limit)
            if not bool(active.any()):
                break
            mask = torch.cat([mask, active[:, None].to(mask.dtype)], dim=1)
            position = position[:, -1:] + 1
            hidden = self.model.model(input_ids=token[:, None], attention_mask=mask, position_ids=position,
                                      use_cache=True, **cache).last_hidden_state[:, -1]
        proof_started = time.perf_counter()
        proofs = builder.finish() if builder is not None else [b""] * rows
        proof_s += time.perf_counter() - proof_started
        token_table = torch.stack(tokens, dim=1).cpu()
        logprob_table = torch.stack(logprobs, dim=1).cpu()
        completions = []
        for row, request in enumerate(requests):
            row_tokens = token_table[row, :request.sampling.max_tokens].tolist()
            length = next((i + 1 for i, t in enumerate(row_tokens) if t == self.eos_id), None)
            finish = "eos" if length is not None else "length"
            length = length or request.sampling.max_tokens
            completions.append(Completion(
                tokens=row_tokens[:length], logprobs=logprob_table[row, :length].tolist(), finish_reason=finish,
                proof=proofs[row], compute_dtype=str(next(self.model.parameters()).dtype).removeprefix("torch."),
                logits=torch.stack([step_logits[row] for step_logits in logits_kept[:length]]).cpu()
                if self.record_logits else None,
            ))
        self.stats.total_s += time.perf_counter() - started
        self.stats.proof_s += proof_s
        self.stats.tokens += sum(len(c.tokens) for c in completions)
        return completions
