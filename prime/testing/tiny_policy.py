"""A small trained policy in Hugging Face format, for the TOPLOC tests and benchmark (and anything else
that needs a model with real, peaked output distributions rather than a random one).

A byte-level Llama trained for a few hundred steps on paragraphs of the built-in corpus, each followed
by EOS, so it ends completions by itself now and then. Built once per machine into the cache
(about 30 s on one core) and reused; `next_version` makes the weights of the version after it.
"""

from __future__ import annotations

import copy
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from prime.core.model import ModelConfig, build_model
from prime.data.builtin_corpus import _documents
from prime.data.tokenizer import ByteTokenizer


class TinyPolicySpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelConfig = ModelConfig(vocab_size=259, hidden_size=128, intermediate_size=384, num_layers=4,
                                     num_heads=4, num_kv_heads=2, max_position_embeddings=512)
    steps: int = Field(120, ge=0)
    batch: int = Field(8, gt=0)
    seq_len: int = Field(128, gt=0)
    lr: float = Field(3e-3, gt=0)
    seed: int = 1

    def key(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:12]


def training_tokens(tokenizer: ByteTokenizer, limit: int = 2_000_000) -> torch.Tensor:
    """Paragraphs of the standard library's sources, each followed by EOS, as one token stream."""
    tokens: list[int] = []
    for _, text in _documents():
        for paragraph in text.split("\n\n"):
            if paragraph.strip():
                tokens += tokenizer.encode(paragraph) + [tokenizer.eos_id]
        if len(tokens) >= limit:
            break
    return torch.tensor(tokens[:limit])


def train_tiny_policy(spec: TinyPolicySpec) -> torch.nn.Module:
    tokenizer = ByteTokenizer()
    model = build_model(spec.model, seed=spec.seed)
    data = training_tokens(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    generator = torch.Generator().manual_seed(spec.seed)
    for _ in range(spec.steps):
        starts = torch.randint(0, len(data) - spec.seq_len - 1, (spec.batch,), generator=generator)
        batch = torch.stack([data[s:s + spec.seq_len + 1] for s in starts.tolist()])
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def save_policy(model: torch.nn.Module, out: Path) -> Path:
    """HF model directory with the byte tokenizer and the EOS/PAD ids a generation engine needs."""
    from prime.tools.export import byte_tokenizer_for_hf

    tokenizer = ByteTokenizer()
    model.config.eos_token_id = tokenizer.eos_id
    model.config.pad_token_id = tokenizer.pad_id
    model.config.bos_token_id = tokenizer.bos_id
    if model.generation_config is not None:
        model.generation_config.eos_token_id = tokenizer.eos_id
        model.generation_config.pad_token_id = tokenizer.pad_id
        model.generation_config.bos_token_id = tokenizer.bos_id
    model.save_pretrained(out)
    byte_tokenizer_for_hf(out)
    return out


def tiny_policy_dir(spec: TinyPolicySpec | None = None, cache: Path | None = None) -> Path:
    """The trained policy's directory in the cache, built atomically on first use (several test
    processes may ask at once)."""
    spec = spec or TinyPolicySpec()
    root = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "prime"
    out = root / f"tiny-policy-{spec.key()}"
    if (out / "spec.json").exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=root))
    try:
        with torch.random.fork_rng():
            save_policy(train_tiny_policy(spec), staging)
        (staging / "spec.json").write_text(spec.model_dump_json(indent=2))
        try:
            staging.rename(out)
        except OSError:
            if not (out / "spec.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def next_version(model: torch.nn.Module, lr: float, seed: int = 0, seq_len: int = 128, batch: int = 8) -> torch.nn.Module:
    """The policy after one more AdamW step of training at lr: what version v is to version v - 1."""
    newer = copy.deepcopy(model).train()
    data = training_tokens(ByteTokenizer(), limit=200_000)
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=generator)
    tokens = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()]).to(next(model.parameters()).device)
    logits = newer(input_ids=tokens[:, :-1]).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    torch.optim.AdamW(newer.parameters(), lr=lr).step()
    newer.zero_grad(set_to_none=True)
    return newer.eval()

