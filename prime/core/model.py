"""The language model: a Hugging Face Llama built from our config with seeded random init.

This module knows nothing of parallelism, precision policies or devices beyond "build it here";
sharding and activation checkpointing are applied from `prime.core.parallelize`.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers import LlamaConfig, LlamaForCausalLM


class ModelConfig(BaseModel):
    """Shape of a Llama-architecture decoder."""

    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(264, gt=0, description="Embedding rows; must hold every token id of the tokenizer.")
    hidden_size: int = Field(256, gt=0, description="Width of the residual stream.")
    intermediate_size: int = Field(768, gt=0, description="Width of the SwiGLU MLP.")
    num_layers: int = Field(6, gt=0, description="Number of transformer blocks.")
    num_heads: int = Field(8, gt=0, description="Attention heads (query).")
    num_kv_heads: int = Field(4, gt=0, description="Key/value heads (grouped-query attention).")
    max_position_embeddings: int = Field(1024, gt=0, description="Longest sequence the model supports.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    rms_norm_eps: float = Field(1e-5, gt=0, description="Epsilon of RMSNorm.")
    tie_word_embeddings: bool = Field(False, description="Share input embedding and output head.")
    init_std: float = Field(0.02, gt=0, description="Std of the normal init of linear and embedding weights.")

    @model_validator(mode="after")
    def _check_heads(self) -> "ModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; "
                f"choose num_heads dividing {self.hidden_size}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}; "
                "grouped-query attention needs a whole number of query heads per key/value head"
            )
        return self

    def to_hf(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            initializer_range=self.init_std,
            attention_bias=False,
            mlp_bias=False,
            use_cache=False,
        )


def build_model(config: ModelConfig, seed: int, device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """A freshly initialised model; the same seed gives the same weights on every process.

    On the meta device no memory is allocated (used to count parameters of large configs).
    """
    hf_config = config.to_hf()
    hf_config._attn_implementation = "sdpa"
    device = torch.device(device)
    fork_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        with device:
            model = LlamaForCausalLM(hf_config)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 × non-embedding params plus attention (PaLM appendix B)."""
    head_dim = config.hidden_size // config.num_heads
    kv = config.num_kv_heads * head_dim
    per_layer = 2 * config.hidden_size * config.hidden_size + 2 * config.hidden_size * kv
    per_layer += 3 * config.hidden_size * config.intermediate_size
    dense = config.num_layers * per_layer + config.vocab_size * config.hidden_size
    attention = 12 * config.num_layers * config.hidden_size * seq_len
    return 6 * dense + attention
