"""The node's local process group: the ranks one `torchrun` started, carrying FSDP2.

Under torchrun it is NCCL on GPUs (with Gloo for CPU tensors) or Gloo on CPU; started as a plain
process it is a one-rank group, so the trainer has a single code path.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class LocalGroup:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def init_local_group(device_choice: str = "auto") -> LocalGroup:
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("train.device = 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if use_cuda:
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
            dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo")
    else:
        rank, world = 0, 1
        device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return LocalGroup(rank=rank, world_size=world, device=device)


def broadcast_json(value: object, rank: int, world_size: int, src: int = 0) -> object:
    """`src`'s JSON value on every local rank (as bytes over the group: nothing is unpickled)."""
    if world_size == 1:
        return value
    data = json.dumps(value).encode() if rank == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src)
    buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank == src
              else torch.empty(int(size), dtype=torch.uint8))
    dist.broadcast(buffer, src=src)
    return json.loads(buffer.numpy().tobytes().decode())


def close_local_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
