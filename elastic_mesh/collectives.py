"""All-reduce (mean) of one flat fp32 tensor over a Gloo group, compressed on the wire.

Two phases, so quantization error does not grow with the number of members (a ring that re-quantizes
partial sums at every hop would):

1. scatter: every member cuts its tensor into one chunk per member, encodes each chunk once and
   sends chunk j to member j (all-to-all). Member j decodes the contributions and sums them in fp32,
   in rank order, then divides by the number of contributors.
2. gather: member j encodes its mean chunk once and all-gathers it. Every member, j included, decodes
   the same bytes, so all members end with bit-identical results.

Before the data moves, members exchange a small header (finite? norm?), so a member whose tensor is
non-finite or absurdly large is left out of the mean by everyone alike and named. Received scales are
checked too: a peer that lies in its header and sends garbage is named in the error.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from elastic_mesh.codecs import BLOCK, Codec


class CollectiveError(RuntimeError):
    """A transfer failed (a peer died, timed out or sent bad data); `blame` names ranks at fault, if known."""

    def __init__(self, message: str, phase: str, blame: list[int] | None = None) -> None:
        super().__init__(message)
        self.phase, self.blame = phase, blame or []


@dataclass
class AllReduceResult:
    mean: torch.Tensor
    contributors: list[int]
    refused: dict[int, str] = field(default_factory=dict)  # rank -> why its tensor was left out
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0


def _wait(work, phase: str) -> None:
    try:
        work.wait()
    except RuntimeError as e:  # Gloo reports a dead or silent peer as RuntimeError/DistBackendError
        raise CollectiveError(f"{phase} failed: {e}", phase) from e


def all_reduce_mean(pg: dist.ProcessGroup, x: torch.Tensor, codec: Codec, contributes: list[bool],
                    valid: bool = True, outlier_factor: float = math.inf,
                    on_phase: Callable[[str], None] | None = None) -> AllReduceResult:
    """Mean of `x` over the members whose `contributes` is true and whose tensor passes the header check.

    valid=False lets a caller that checked more than this tensor (e.g. all shards of a node) refuse it;
    a norm above outlier_factor × the median of the others' (3+ contributors) is refused as absurd.
    """
    started = time.perf_counter()
    rank, world = pg.rank(), pg.size()
    x = x.detach().reshape(-1).float().cpu()
    norm = float(x.norm()) if x.numel() else 0.0
    finite = valid and math.isfinite(norm)
    header = torch.tensor([1.0 if finite else 0.0, norm if finite else 0.0,
                           1.0 if contributes[rank] else 0.0, float(x.numel())])
    headers = [torch.empty(4) for _ in range(world)]
    _wait(pg.allgather([headers], [header]), "header")
    sizes = {int(h[3]) for h in headers}
    if len(sizes) != 1:
        raise CollectiveError(f"members disagree on the tensor size: {sorted(sizes)}", "header")
    refused: dict[int, str] = {}
    for r, h in enumerate(headers):
        if contributes[r] and h[0] == 0:
            refused[r] = "non-finite values"
    norms = {r: float(h[1]) for r, h in enumerate(headers) if contributes[r] and r not in refused}
    for r, n in norms.items():
        others = sorted(v for q, v in norms.items() if q != r)
        if len(others) >= 2 and n > outlier_factor * max(others[len(others) // 2], 1e-30):
            refused[r] = f"norm {n:.3g} is over {outlier_factor:g}× the others' median {others[len(others) // 2]:.3g}"
    contributors = [r for r in range(world) if contributes[r] and r not in refused]
    total = x.numel()
    if not contributors or total == 0:
        return AllReduceResult(torch.zeros_like(x), contributors, refused, seconds=time.perf_counter() - started)

    chunk = -(-total // world)
    chunk = -(-chunk // BLOCK) * BLOCK
    padded = torch.zeros(chunk * world)
    if rank in contributors:
        padded[:total] = x
    encoded = codec.encoded_size(chunk)
    send = torch.cat([codec.encode(padded[j * chunk:(j + 1) * chunk]) for j in range(world)])
    recv = torch.empty_like(send)
    _wait(pg.alltoall_base(recv, send, [], []), "scatter")
    if on_phase:
        on_phase("scatter")

    # A chunk cannot be larger than the whole tensor its sender declared; int8 carries no NaN, so this
    # (with finite scales) is what catches a peer that lies in its header and sends garbage.
    slack = 1.05
    mean_chunk = torch.zeros(chunk)
    for r in contributors:
        part = codec.decode(recv[r * encoded:(r + 1) * encoded], chunk)
        part_norm = float(part.norm())
        if not math.isfinite(part_norm) or part_norm > slack * float(headers[r][1]) + 1e-12:
            raise CollectiveError(f"rank {r} sent data for chunk {rank} that does not match its header "
                                  f"(norm {part_norm:.3g}, declared {float(headers[r][1]):.3g})", "scatter", blame=[r])
        mean_chunk += part
    mean_chunk /= len(contributors)

    mine = codec.encode(mean_chunk)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    _wait(pg.allgather([gathered], [mine]), "gather")
    if on_phase:
        on_phase("gather")
    bound = slack * slack * max(float(headers[r][1]) for r in contributors) + 1e-12
    pieces = []
    for r, buf in enumerate(gathered):
        piece = codec.decode(buf, chunk)
        piece_norm = float(piece.norm())
        if not math.isfinite(piece_norm) or piece_norm > bound:
            raise CollectiveError(f"rank {r} sent a mean chunk larger than any input (norm {piece_norm:.3g})",
                                  "gather", blame=[r])
        pieces.append(piece)
    mean = torch.cat(pieces)[:total]
    moved = (world - 1) * encoded * 2 + (world - 1) * 16  # both phases plus the headers
    return AllReduceResult(mean, contributors, refused, moved, moved, time.perf_counter() - started)
