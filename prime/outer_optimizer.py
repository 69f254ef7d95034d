"""The outer params (fp32, CPU) of this rank's shards and the outer Nesterov step over them."""

from __future__ import annotations

import hashlib

import torch


def local_shards(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's piece of every parameter (the local shard of an FSDP2 DTensor, or the tensor itself)."""
    return [p.to_local() if hasattr(p, "to_local") else p.data for p in model.parameters()]


class OuterOptimizer:
    """Outer params (fp32, CPU) and Nesterov SGD over them, for this rank's shards."""

    def __init__(self, shards: list[torch.Tensor], lr: float, momentum: float) -> None:
        self.outer = [s.detach().float().cpu().clone() for s in shards]
        self.sizes = [t.numel() for t in self.outer]
        self.optimizer = torch.optim.SGD(self.outer, lr=lr, momentum=momentum, nesterov=momentum > 0)

    def pseudo_gradient(self, shards: list[torch.Tensor], start: list[torch.Tensor] | None = None) -> torch.Tensor:
        """start − inner, flattened (one collective for all parameters); start is the outer params unless
        the round began elsewhere (the delayed mode keeps local progress past an outer step)."""
        if not self.outer:
            return torch.zeros(0)
        start = self.outer if start is None else start
        return torch.cat([(o - s.detach().float().cpu()).reshape(-1) for o, s in zip(start, shards)])

    def apply(self, mean_pseudo_gradient: torch.Tensor) -> None:
        """The outer Nesterov step on the outer params only (the model is not touched)."""
        for o, g in zip(self.outer, mean_pseudo_gradient.split(self.sizes)):
            o.grad = g.view_as(o).clone()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, mean_pseudo_gradient: torch.Tensor, shards: list[torch.Tensor]) -> None:
        self.apply(mean_pseudo_gradient)
        self.copy_to(shards)

    def copy_to(self, shards: list[torch.Tensor], minus: torch.Tensor | None = None) -> None:
        """shards ← outer params (− `minus`, a flat pseudo-gradient: the local progress to keep)."""
        pieces = minus.split(self.sizes) if minus is not None else [None] * len(self.outer)
        with torch.no_grad():
            for o, s, d in zip(self.outer, shards, pieces):
                value = o if d is None else o - d.view_as(o)
                s.copy_(value.view_as(s).to(device=s.device, dtype=s.dtype))

    def state_tensor(self) -> torch.Tensor:
        """Outer params then momentum buffers, flat: what a joiner needs."""
        momentum = [self.optimizer.state.get(o, {}).get("momentum_buffer") for o in self.outer]
        flat = [o.reshape(-1) for o in self.outer]
        flat += [(m if m is not None else torch.zeros_like(o)).reshape(-1) for m, o in zip(momentum, self.outer)]
        return torch.cat(flat) if flat else torch.zeros(0)

    def load_state_tensor(self, state: torch.Tensor) -> None:
        total = sum(self.sizes)
        with torch.no_grad():
            for o, piece in zip(self.outer, state[:total].split(self.sizes)):
                o.copy_(piece.view_as(o))
            for o, piece in zip(self.outer, state[total:].split(self.sizes)):
                self.optimizer.state[o]["momentum_buffer"] = piece.view_as(o).clone()

    def digest(self) -> bytes:
        h = hashlib.blake2b(digest_size=32)
        for o in self.outer:
            h.update(o.numpy().tobytes())
        return h.digest()
