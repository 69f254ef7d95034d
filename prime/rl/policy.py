"""A policy to post-train from scratch for the built-in task: a tiny Llama over a character tokenizer
(digits, "=", BOS, EOS, PAD), saved as a Hugging Face directory like any other policy."""

from __future__ import annotations

from pathlib import Path

import torch

from prime.core.model import ModelConfig, build_model

CHARACTERS = "0123456789="
SPECIALS = {"<s>": len(CHARACTERS), "</s>": len(CHARACTERS) + 1, "<pad>": len(CHARACTERS) + 2,
            "<unk>": len(CHARACTERS) + 3}
DIGIT_MODEL = ModelConfig(vocab_size=len(CHARACTERS) + len(SPECIALS), hidden_size=128, intermediate_size=256,
                          num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=64)


def save_character_tokenizer(out: Path) -> None:
    """One token per character of CHARACTERS, plus the specials, as a HF fast tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(CHARACTERS)} | SPECIALS
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens(list(SPECIALS))
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(out)


def new_digit_policy(out: Path, seed: int = 0, config: ModelConfig = DIGIT_MODEL) -> Path:
    """A freshly initialised policy directory (weights, config with EOS/PAD, tokenizer)."""
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng():
        model = build_model(config, seed=seed)
    for target in (model.config, model.generation_config):
        if target is not None:
            target.bos_token_id, target.eos_token_id, target.pad_token_id = (
                SPECIALS["<s>"], SPECIALS["</s>"], SPECIALS["<pad>"])
    model.save_pretrained(out)
    save_character_tokenizer(out)
    return out
