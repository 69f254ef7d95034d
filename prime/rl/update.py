"""One policy update from scored groups: what the synchronous loop and the trainer process both run.

Rows are completions with the advantage their group gave them (computed by whoever scored them: the
loop here, the orchestrator in a distributed run); `old` logprobs are the generating policy's, as the
worker reported them and the verifier checked them. `epochs` > 1 takes several optimizer steps on the
same rows, which is where the two-sided ratio clipping starts to matter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prime.rl.grpo import GRPOConfig, grpo_loss, token_logprobs


@dataclass
class Row:
    """A completion to learn from: its prompt and tokens, the logprobs it was sampled with, its advantage."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    advantage: float


def tensors(rows: list[Row], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [rows, width] right-padded; mask, old logprobs [rows, width - 1] aligned with the logits that
    chose each completion token; advantages [rows]."""
    width = max(len(r.prompt) + len(r.tokens) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    mask = torch.zeros(len(rows), width - 1)
    old = torch.zeros(len(rows), width - 1)
    for i, r in enumerate(rows):
        sequence = r.prompt + r.tokens
        ids[i, :len(sequence)] = torch.tensor(sequence)
        start = len(r.prompt) - 1  # the position whose logits chose the first completion token
        mask[i, start:start + len(r.tokens)] = 1
        old[i, start:start + len(r.tokens)] = torch.tensor(r.logprobs, dtype=torch.float32)
    return ids, mask, old, torch.tensor([r.advantage for r in rows], dtype=torch.float32)


def policy_update(model, optimizer, rows: list[Row], config: GRPOConfig, temperature: float, pad_id: int,
                  epochs: int = 1, max_grad_norm: float = 1.0, reference=None, loss_scale: float = 1.0) -> dict[str, float]:
    """`epochs` optimizer steps on `rows`; the statistics of the first pass (its ratios measure how far
    the rows' generating versions are from this one) and the clipping of the last. reference: a frozen
    model for the KL term (config.kl_coef > 0). loss_scale multiplies what is backpropagated (a rank's
    share of a batch split over data-parallel ranks, see sharded_update)."""
    if not rows:
        return {"loss": 0.0, "rows": 0.0}
    ids, mask, old, advantages = tensors(rows, pad_id)
    reference_logprobs = None
    if reference is not None and config.kl_coef > 0:
        with torch.no_grad():
            reference_logprobs = token_logprobs(reference(input_ids=ids).logits[:, :-1], ids[:, 1:], temperature)
    model.train()
    stats: dict[str, float] = {"rows": float(len(rows))}
    proximal = None
    for epoch in range(epochs):
        logits = model(input_ids=ids).logits[:, :-1]  # right padding, causal: pads are never attended to
        new = token_logprobs(logits, ids[:, 1:], temperature)
        if config.decoupled and proximal is None:
            proximal = new.detach()  # the policy before this batch's first step
        with torch.set_grad_enabled(config.entropy_coef > 0):  # a bonus needs its gradient; a statistic does not
            logp = torch.log_softmax(logits.float() / temperature, -1)
            entropy = -(logp.exp() * logp).sum(-1)
        loss, loss_stats = grpo_loss(new, old, advantages, mask, config, reference=reference_logprobs,
                                     entropy=entropy, proximal=proximal)
        optimizer.zero_grad(set_to_none=True)
        (loss * loss_scale).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        if epoch == 0:
            norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP2: a DTensor
            stats |= loss_stats | {"loss": loss.item(), "grad_norm": norm.item()}
        if epoch == epochs - 1 and epochs > 1:
            stats |= {"last_clip_fraction": loss_stats["clip_fraction"], "last_ratio_max": loss_stats["ratio_max"]}
    model.eval()
    return stats


def sharded_update(model, optimizer, rows: list[Row], config: GRPOConfig, temperature: float, pad_id: int,
                   rank: int, world_size: int, epochs: int = 1, max_grad_norm: float = 1.0,
                   reference=None) -> dict[str, float]:
    """policy_update over data-parallel ranks (FSDP2), equal to one process updating on all `rows`.

    Every rank holds the whole batch and takes every world_size-th row. Its loss is a mean over its own
    completion tokens; scaled by world_size × its tokens / all tokens, the gradients FSDP2 averages over
    the ranks are those of the mean over all tokens, and clipping sees the same norm as one process. A
    batch with fewer rows than ranks (but some) is left out on every rank: a rank without rows would skip
    the collectives the others wait in."""
    if world_size == 1:
        return policy_update(model, optimizer, rows, config, temperature, pad_id, epochs, max_grad_norm, reference)
    if len(rows) < world_size:
        return {"loss": 0.0, "rows": 0.0, "skipped_rows": float(len(rows))}
    mine = rows[rank::world_size]
    total = sum(len(r.tokens) for r in rows)
    scale = world_size * sum(len(r.tokens) for r in mine) / max(total, 1)
    stats = policy_update(model, optimizer, mine, config, temperature, pad_id, epochs, max_grad_norm, reference,
                          loss_scale=scale)
    return {**stats, "rows": float(len(rows))}
