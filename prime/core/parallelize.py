"""Applies FSDP2, mixed precision and activation checkpointing to a model from outside its code."""

from __future__ import annotations

import logging

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

log = logging.getLogger(__name__)


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def parallelize(model: torch.nn.Module, device: torch.device, world_size: int, dtype: torch.dtype,
                activation_checkpointing: bool, shard_single_rank: bool = False) -> torch.nn.Module:
    """Shards each transformer block, then the root, over the local group.

    With one local rank there is nothing to shard, so the model stays plain (FSDP2 would only add
    overhead); bf16 then comes from autocast in the trainer instead of the FSDP2 policy.
    """
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not uses_fsdp(world_size, shard_single_rank):
        return model
    mesh = init_device_mesh(device.type, (world_size,))
    # Parameters are gathered in the compute dtype; gradients are reduced and kept in fp32.
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def uses_fsdp(world_size: int, shard_single_rank: bool = False) -> bool:
    return world_size > 1 or shard_single_rank
