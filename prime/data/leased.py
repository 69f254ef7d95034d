"""A worker's token stream in a multi-node run: shards leased from the coordinator, read exactly once.

The worker reads `data.interleave` leased shards at once, each from its committed cursor (document,
token offset), drawing every window from one of them in a seeded order (prime/data/interleave.py);
when a shard runs out it leases another. What it read since the last outer step is reported with its vote; the
coordinator moves the cursors only if the step averaged this worker's pseudo-gradient. If it did not
(the node was refused, missed the step, or was dropped), the worker rewinds to the committed cursors
and reads the same tokens again, so nothing is lost and nothing is counted twice.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from prime.data.interleave import ReadHeads
from prime.data.loader import pack_shard
from prime.data.shards import Shard
from prime.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(eq=False)  # hashed by identity: a mark keys on the held shard itself
class HeldShard:
    shard: int
    pass_: int
    start: tuple[int, int]  # committed cursor: where this round's reading began
    end: tuple[int, int]  # the first token not consumed yet
    finished: bool = False  # read to its end in this round (the next pass is someone's, after the commit)

    def report(self, worker: int) -> dict:
        return {"worker": worker, "item": self.shard, "pass": self.pass_, "start": _cursor(self.start),
                "end": _cursor(self.end), "finished": self.finished}


def _cursor(position: tuple[int, int]) -> list[int]:
    return [] if position == (0, 0) else list(position)


def cursor_position(cursor: list[int]) -> tuple[int, int]:
    """(document, token offset) of a ledger cursor; [] is the top of the shard."""
    if not cursor:
        return 0, 0
    if len(cursor) != 2:
        raise ValueError(f"a data cursor is [document, token offset], got {cursor}")
    return int(cursor[0]), int(cursor[1])


class LeasedSequenceStream:
    """Yields windows of seq_len + 1 tokens from leased shards, `interleave` of them read at once
    (prime/data/interleave.py). `lease(held, spare)` asks the coordinator for a shard given the shards
    the worker holds already: {"item", "pass", "cursor"}; {"item": None} when `spare` (the worker still
    reads another shard) and the coordinator keeps the free ones for other workers; None when the
    coordinator dropped this node."""

    def __init__(self, shards: list[Shard], tokenizer: Tokenizer, seq_len: int, text_field: str,
                 lease: Callable[[list[int], bool], dict | None], worker: int, interleave: int = 1,
                 seed: int = 0) -> None:
        self.shards, self.tokenizer, self.seq_len, self.text_field = shards, tokenizer, seq_len, text_field
        self.lease, self.worker, self.interleave, self.seed = lease, worker, interleave, seed
        self.held: list[HeldShard] = []  # in leasing order; the unfinished ones are being read
        # Rounds marked and not yet settled, oldest first (overlapped modes: several outer steps may be in
        # flight): held shard -> (end, finished) when the round was marked.
        self._marks: deque[dict[HeldShard, tuple[tuple[int, int], bool]]] = deque()

    def _windows(self, held: HeldShard):
        return pack_shard(self.shards[held.shard], self.tokenizer, self.seq_len, self.text_field, *held.end)

    def __iter__(self) -> Iterator[torch.Tensor]:
        heads: ReadHeads[HeldShard] = ReadHeads(self.seed, lambda h: (h.shard, h.pass_, *h.end))
        live: list[HeldShard] = []
        for held in self.held:
            if not held.finished:
                if heads.add(held, self._windows(held)):
                    live.append(held)
                else:
                    held.finished = True
        self._top_up(heads, live)
        while heads:
            held, sample, position, windows = heads.take()
            held.end = position
            # The read-ahead tells at once whether this was the shard's last window: it is reported
            # finished with the round that consumed that window, and a new shard takes its place.
            if not heads.add(held, windows):
                held.finished = True
                live.remove(held)
                self._top_up(heads, live)
            yield sample

    def _top_up(self, heads: ReadHeads[HeldShard], live: list[HeldShard]) -> None:
        """Leases shards until `interleave` are being read; beyond the first only spare ones, which the
        coordinator grants while it keeps enough free for the other workers."""
        while len(live) < self.interleave:
            held = self._new_lease(spare=bool(live))
            if held is None:
                if not live:
                    raise RuntimeError("the coordinator leased no data shard to a worker that reads none")
                return
            self.held.append(held)
            if heads.add(held, self._windows(held)):
                live.append(held)
            else:  # too short for one window: finished as soon as leased (its tokens are the dropped tail)
                held.finished = True

    def _new_lease(self, spare: bool) -> HeldShard | None:
        answer = self.lease([h.shard for h in self.held if h.pass_ >= 0], spare)
        if answer is None:
            if spare:
                return None  # dropped: the filler shard being read is enough
            # The coordinator dropped this node (e.g. after a partition): whatever it reads until the
            # round ends is thrown away when it rejoins. Re-read a shard it knows, never reported.
            log.warning("worker %d got no data lease (this node was dropped); this round's work will be discarded",
                        self.worker)
            known = self.held[-1].shard if self.held else 0
            return HeldShard(known, -1, (0, 0), (0, 0))
        if answer.get("item") is None:
            if not spare:
                raise RuntimeError(f"the coordinator answered a data lease without a shard: {answer}")
            return None
        shard = int(answer["item"])
        if not 0 <= shard < len(self.shards):
            raise ValueError(f"the coordinator leased data shard {shard} but this node has {len(self.shards)}; "
                             "every node must read the same files with the same data.parts_per_file")
        position = cursor_position(answer.get("cursor") or [])
        log.debug("worker %d leased shard %s (pass %d) at %s", self.worker, self.shards[shard].name, answer["pass"],
                  position)
        return HeldShard(shard, int(answer["pass"]), position, position)

    def report(self) -> list[dict]:
        """What was read since the last commit (the vote carries it to the coordinator)."""
        # Filler read while the node was dropped is never reported: the coordinator refuses the dropped
        # node's vote anyway, and the node forgets these leases when it rejoins.
        return [h.report(self.worker) for h in self.held if h.pass_ >= 0 and (h.finished or h.end != h.start)]

    def mark(self) -> list[dict]:
        """A round ends while reading goes on (the overlapped modes: its outer step is decided during the
        next inner steps): what it read since the round marked before it (or since the last commit), to
        report now, and the point its committed() moves the cursors to. Rounds marked before it may still
        be in flight; the coordinator commits them in order, so its report starts where theirs end."""
        since = self._marks[-1] if self._marks else {}
        ranges = []
        for h in self.held:
            start, done = since.get(h, (h.start, False))
            if h.pass_ >= 0 and not done and (h.finished or h.end != start):
                ranges.append(HeldShard(h.shard, h.pass_, start, h.end, h.finished).report(self.worker))
        self._marks.append({h: (h.end, h.finished) for h in self.held})
        return ranges

    def committed(self) -> None:
        """The step averaged this worker's reading: cursors move on (to the oldest mark, if rounds were
        marked), finished shards go back to the pool. In place: a running iterator goes on with the shard
        it is reading, without re-reading the file."""
        marks = self._marks.popleft() if self._marks else None
        kept = []
        for h in self.held:
            end, finished = marks.get(h, (h.start, False)) if marks is not None else (h.end, h.finished)
            if not finished:
                h.start = end
                kept.append(h)
        self.held[:] = kept

    def rewind(self) -> None:
        """The step did not average this worker's reading: read the same tokens again (the caller starts a
        new iterator)."""
        self._marks.clear()
        self.held = [HeldShard(h.shard, h.pass_, h.start, h.start) for h in self.held if h.pass_ >= 0]

    def forget(self) -> None:
        """The coordinator dropped this node: its leases went back to the pool; lease anew."""
        self._marks.clear()
        self.held = []
