"""The outer params (fp32, CPU) of this rank's shards and the outer Nesterov step over them."""

from __future__ import annotations

import hashlib

import torch


def local_shards(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's piece of every parameter (the local shard of an FSDP2 DTensor, or the tensor itself)."""
    return [p.to_local() if hasattr(p, "to_local") else p.data for p in model.parameters()]


# A fragment of the outer params: (parameter index, first element, end) runs over flattened parameters.
Piece = tuple[int, int, int]


def split_evenly(sizes: list[int], parts: int) -> list[list[Piece]]:
    """`parts` fragments (streaming DiLoCo) of equal element counts, ±1: the parameters laid end to end
    in order and cut into consecutive runs, a cut falling inside a parameter where it must. Every
    fragment's all-reduce gets the same window, so the largest sets the rate the link must carry; cut
    at parameter boundaries, one big tensor (an embedding) would make its fragment the largest."""
    total = sum(sizes)
    bounds = [total * k // parts for k in range(parts + 1)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [[(i, max(lo, start) - start, min(hi, start + size) - start)
             for i, (start, size) in enumerate(zip(starts, sizes)) if max(lo, start) < min(hi, start + size)]
            for lo, hi in zip(bounds, bounds[1:])]


def _flat(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Elements lo:hi of a tensor, flattened: a view (writes reach the tensor) when it is contiguous."""
    return t.reshape(-1)[lo:hi]


def _write(shard: torch.Tensor, lo: int, hi: int, value: torch.Tensor) -> None:
    """shard's elements lo:hi ← value (fp32, CPU), in the shard's own device and dtype."""
    value = value.to(device=shard.device, dtype=shard.dtype)
    if shard.is_contiguous():
        shard.view(-1)[lo:hi].copy_(value)
    else:  # a strided local shard: reshape would copy, so write the whole tensor back
        flat = shard.reshape(-1).clone()
        flat[lo:hi] = value
        shard.copy_(flat.view_as(shard))


class OuterOptimizer:
    """Outer params (fp32, CPU) and Nesterov SGD over them, for this rank's shards; `fragments` cuts the
    parameters into runs that can be synchronised one at a time (streaming DiLoCo; 1: all at once).
    The step is torch's SGD (dampening 0) written out, so that it can update part of a parameter."""

    def __init__(self, shards: list[torch.Tensor], lr: float, momentum: float, fragments: int = 1) -> None:
        # Contiguous, so a fragment's elements are views the step updates in place.
        self.outer = [s.detach().float().cpu().clone(memory_format=torch.contiguous_format) for s in shards]
        self.sizes = [t.numel() for t in self.outer]
        self.fragments = split_evenly(self.sizes, fragments)
        self.lr, self.momentum = lr, momentum
        # Momentum, zeros to start (what torch's first step amounts to); none at momentum 0, like torch.
        self.buffers = [torch.zeros_like(o) for o in self.outer] if momentum > 0 else []
        self._all = [(i, 0, n) for i, n in enumerate(self.sizes)]
        self._digests: dict[int, tuple[torch.Tensor, int, bytes]] = {}  # see digest()
        # fragment -> (the other nodes' mean pseudo-gradient in its last outer step, how many): eager "mixed"
        self._others: dict[int | None, tuple[torch.Tensor, int]] = {}

    def _pieces(self, fragment: int | None) -> list[Piece]:
        return self._all if fragment is None else self.fragments[fragment]

    def _split(self, flat: torch.Tensor, pieces: list[Piece]) -> list[torch.Tensor]:
        return list(flat.split([hi - lo for _, lo, hi in pieces]))

    def _direction(self, i: int, lo: int, hi: int, g: torch.Tensor, keep: bool) -> torch.Tensor:
        """What the step subtracts, × lr; keep: the momentum buffer moves too (else it is left alone)."""
        mu = self.momentum
        if mu == 0:
            return g
        buf = _flat(self.buffers[i], lo, hi)
        buf = buf.mul_(mu).add_(g) if keep else buf.mul(mu).add_(g)
        return g.add(buf, alpha=mu)  # Nesterov

    def span(self, fragment: int | None = None) -> tuple[int, int]:
        """The fragment's values as one run of the flat parameters (split_evenly cuts consecutive runs)."""
        pieces = self._pieces(fragment)
        if not pieces:
            return 0, 0
        starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        (first, lo, _), (last, _, hi) = pieces[0], pieces[-1]
        return starts[first] + lo, starts[last] + hi

    def pseudo_gradient(self, shards: list[torch.Tensor], fragment: int | None = None) -> torch.Tensor:
        """outer − inner over the fragment (everything by default), flattened: one collective."""
        pieces = self._pieces(fragment)
        if not pieces:
            return torch.zeros(0)
        return torch.cat([_flat(self.outer[i], lo, hi) - _flat(shards[i].detach(), lo, hi).float().cpu()
                          for i, lo, hi in pieces])

    def apply(self, mean_pseudo_gradient: torch.Tensor, fragment: int | None = None) -> None:
        """The outer Nesterov step on the fragment's outer params only (the model is not touched)."""
        pieces = self._pieces(fragment)
        with torch.no_grad():
            for (i, lo, hi), g in zip(pieces, self._split(mean_pseudo_gradient, pieces)):
                _flat(self.outer[i], lo, hi).add_(self._direction(i, lo, hi, g, keep=True), alpha=-self.lr)

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
        return [_flat(shards[i].detach(), lo, hi).float().cpu().clone() for i, lo, hi in self._pieces(fragment)]

    def eager_step(self, shards: list[torch.Tensor], pseudo_gradient: torch.Tensor, fragment: int | None,
                   mixed: bool = False) -> bool:
        """The fragment's inner shards ← the outer params after an outer step taken with an estimate of the
        average that is in flight (eager updates: what a node resumes from meanwhile; the outer params
        and momentum themselves are not changed, so the average replaces the estimate when it lands).
        The estimate is this node's own pseudo-gradient, or with `mixed` (Kale et al. 2025) the average
        of its own and the others' from their last step (remember_others), each counted once per node.
        Returns whether the mixed estimate was used (False: no last step of the others to mix with)."""
        pieces = self._pieces(fragment)
        others = self._others.get(fragment) if mixed else None
        if others is not None and others[0].numel() != pseudo_gradient.numel():
            others = None  # a differently cut fragment (not seen within one run): own estimate
        estimate = pseudo_gradient if others is None else (pseudo_gradient + others[0] * others[1]) / (others[1] + 1)
        with torch.no_grad():
            for (i, lo, hi), g in zip(pieces, self._split(estimate, pieces)):
                step = self.lr * self._direction(i, lo, hi, g, keep=False)
                _write(shards[i], lo, hi, _flat(self.outer[i], lo, hi) - step)
        return others is not None

    def forget_others(self) -> None:
        """After a catch-up: the others' last steps it remembers are from before the gap; own estimates until
        the next outer step it takes part in."""
        self._others.clear()

    def remember_others(self, fragment: int | None, mean: torch.Tensor, own: torch.Tensor | None, nodes: int) -> None:
        """Keeps the mean pseudo-gradient of the other nodes in an outer step of `nodes` contributors, for the
        mixed eager estimate of the next one: the mean with this node's share taken out (own: what this
        node contributed; None: it contributed nothing, so the mean is the others' already)."""
        if own is None:
            self._others[fragment] = (mean.clone(), nodes)
        elif nodes > 1:
            self._others[fragment] = ((mean * nodes - own) / (nodes - 1), nodes - 1)
        else:  # alone: there are no others to estimate
            self._others.pop(fragment, None)

    def merge(self, shards: list[torch.Tensor], launched_from: list[torch.Tensor], fragment: int | None) -> None:
        """The fragment's inner shards ← new outer params + the local progress made since the outer step
        was launched from `launched_from` (overlapped modes: nothing is thrown away while waiting)."""
        with torch.no_grad():
            for (i, lo, hi), start in zip(self._pieces(fragment), launched_from):
                local = _flat(shards[i].detach(), lo, hi).float().cpu()
                _write(shards[i], lo, hi, _flat(self.outer[i], lo, hi) + (local - start))

    def state_tensor(self) -> torch.Tensor:
        """Outer params then momentum buffers, flat: what a joiner needs."""
        momentum = self.buffers or [torch.zeros_like(o) for o in self.outer]  # the same layout at momentum 0
        flat = [o.reshape(-1) for o in self.outer] + [b.reshape(-1) for b in momentum]
        return torch.cat(flat) if flat else torch.zeros(0)

    def load_state_tensor(self, state: torch.Tensor) -> None:
        total = sum(self.sizes)
        with torch.no_grad():
            for o, piece in zip(self.outer, state[:total].split(self.sizes)):
                o.copy_(piece.view_as(o))
            for b, piece in zip(self.buffers, state[total:].split(self.sizes)):
                b.copy_(piece.view_as(b))

    def digest(self) -> bytes:
        """A hash of the outer params (the model hash nodes compare after every outer step): the hash of
        each parameter's hash. A parameter's hash is kept until its tensor's version counter moves,
        which every in-place torch write does (through views too; all of this class's writes are
        such), so a streaming outer step hashes only the parameters its fragment touched, not the
        whole model (24 MB on cpu-demo: ~45 ms of a core, five times per H)."""
        root = hashlib.sha256()
        for i, o in enumerate(self.outer):
            version = o._version  # read first: a write during the hash leaves a stale entry, not a wrong one
            cached = self._digests.get(i)
            if cached is None or cached[0] is not o or cached[1] != version:
                cached = self._digests[i] = (o, version, hashlib.sha256(memoryview(o.numpy()).cast("B")).digest())
            root.update(cached[2])
        return root.digest()
