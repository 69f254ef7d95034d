"""The outer params (fp32, CPU) of this rank's shards and the outer Nesterov step over them."""

from __future__ import annotations

import hashlib

import torch


def local_shards(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's piece of every parameter (the local shard of an FSDP2 DTensor, or the tensor itself)."""
    return [p.to_local() if hasattr(p, "to_local") else p.data for p in model.parameters()]


def split_evenly(sizes: list[int], parts: int) -> list[range]:
    """`parts` contiguous runs of parameter indices (the fragments of streaming DiLoCo: consecutive
    parameters, i.e. whole layers, together) whose largest element count is as small as it can be:
    each fragment's all-reduce has the same window, so the largest one sets the rate the link must
    carry. Binary search on that largest count, each guess checked greedily: O(n log total)."""
    n = len(sizes)
    if parts >= n:  # a parameter each, then empty fragments
        return [range(min(k, n), min(k + 1, n)) for k in range(parts)]

    def cuts(cap: int) -> list[int] | None:
        """Starts of `parts` non-empty runs of at most `cap` elements each (then n), or None."""
        bounds, load = [0], 0
        for i, size in enumerate(sizes):  # cap is never below the largest size: every item fits a run
            if i > bounds[-1] and load + size > cap:
                bounds.append(i)
                load = 0
                if len(bounds) > parts:
                    return None
            load += size
            if n - (i + 1) == parts - len(bounds) > 0:  # as many items left as runs to open: one each
                return bounds + list(range(i + 1, n + 1))
        return bounds + [n] if len(bounds) == parts else None

    low, high = max(sizes), sum(sizes)
    while low < high:
        mid = (low + high) // 2
        if cuts(mid) is None:
            low = mid + 1
        else:
            high = mid
    bounds = cuts(low)
    return [range(bounds[k], bounds[k + 1]) for k in range(parts)]


class OuterOptimizer:
    """Outer params (fp32, CPU) and Nesterov SGD over them, for this rank's shards; `fragments` cuts the
    parameters into runs that can be synchronised one at a time (streaming DiLoCo; 1: all at once)."""

    def __init__(self, shards: list[torch.Tensor], lr: float, momentum: float, fragments: int = 1) -> None:
        self.outer = [s.detach().float().cpu().clone() for s in shards]
        self.sizes = [t.numel() for t in self.outer]
        self.fragments = split_evenly(self.sizes, fragments)
        self.optimizer = torch.optim.SGD(self.outer, lr=lr, momentum=momentum, nesterov=momentum > 0)

    def _params(self, fragment: int | None) -> range:
        return range(len(self.outer)) if fragment is None else self.fragments[fragment]

    def pseudo_gradient(self, shards: list[torch.Tensor], fragment: int | None = None) -> torch.Tensor:
        """outer − inner over the fragment's parameters (all by default), flattened: one collective."""
        index = self._params(fragment)
        if not index:
            return torch.zeros(0)
        return torch.cat([(self.outer[i] - shards[i].detach().float().cpu()).reshape(-1) for i in index])

    def apply(self, mean_pseudo_gradient: torch.Tensor, fragment: int | None = None) -> None:
        """The outer Nesterov step on the fragment's outer params only (the model is not touched)."""
        index = self._params(fragment)
        for i, g in zip(index, mean_pseudo_gradient.split([self.sizes[i] for i in index])):
            self.outer[i].grad = g.view_as(self.outer[i]).clone()
        self.optimizer.step()  # parameters without a gradient (other fragments) are left alone
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, mean_pseudo_gradient: torch.Tensor, shards: list[torch.Tensor]) -> None:
        self.apply(mean_pseudo_gradient)
        self.copy_to(shards)

    def copy_to(self, shards: list[torch.Tensor]) -> None:
        """shards ← outer params."""
        with torch.no_grad():
            for o, s in zip(self.outer, shards):
                s.copy_(o.view_as(s).to(device=s.device, dtype=s.dtype))

    def snapshot(self, shards: list[torch.Tensor], fragment: int | None = None) -> list[torch.Tensor]:
        """fp32 CPU copies of the fragment's inner shards (where an overlapped outer step was launched)."""
        return [shards[i].detach().float().cpu().clone() for i in self._params(fragment)]

    def eager_step(self, shards: list[torch.Tensor], pseudo_gradient: torch.Tensor, fragment: int | None) -> None:
        """The fragment's inner shards ← the outer params after an outer step taken with this node's own
        pseudo-gradient standing in for the average (eager updates: what a node resumes from while the
        real average is in flight; the outer params and momentum themselves are not changed)."""
        group = self.optimizer.param_groups[0]
        lr, mu, nesterov = group["lr"], group["momentum"], group["nesterov"]
        index = self._params(fragment)
        with torch.no_grad():
            for i, g in zip(index, pseudo_gradient.split([self.sizes[i] for i in index])):
                o, g = self.outer[i], g.view_as(self.outer[i])
                buf = self.optimizer.state.get(o, {}).get("momentum_buffer")
                buf = g if buf is None or mu == 0 else buf * mu + g  # torch's SGD, dampening 0
                direction = g + mu * buf if nesterov else buf
                s = shards[i]
                s.copy_((o - lr * direction).view_as(s).to(device=s.device, dtype=s.dtype))

    def merge(self, shards: list[torch.Tensor], launched_from: list[torch.Tensor], fragment: int | None) -> None:
        """The fragment's inner shards ← new outer params + the local progress made since the outer step
        was launched from `launched_from` (overlapped modes: nothing is thrown away while waiting)."""
        with torch.no_grad():
            for i, start in zip(self._params(fragment), launched_from):
                s = shards[i]
                value = self.outer[i] + (s.detach().float().cpu() - start)
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
