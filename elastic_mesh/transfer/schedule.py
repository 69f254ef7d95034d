"""Which request a download makes next: the scheduling core of the download engine (fetcher.py), with
no socket, thread or clock of its own, so every rule below is tested by calling it.

Given which chunks are held, who holds what (source -> bitmap, None: everything), which sources are
seeders (a broadcast's origin) and what is in flight, `next()` answers one of:

- a chunk of a source: rarest chunks first among their holders, ties in this member's shuffled order
  (so members fetch different chunks), the source as the SourcePicker prefers it by measured rate;
- a seeded request: when only seeders hold what is missing, the seeder chooses among all such chunks
  (super-seeding: its uplink carries each chunk about once, the members pass it on);
- a standing request: a peer still fetching the same version, holding nothing to ask for yet, answers
  one the moment it verifies a chunk this side lacks (`wait_s`; with streamed answers every such peer
  gets one from the start, and relays over it each chunk it took from a seeder);
- in the endgame, when every missing chunk is in flight, a second source for a chunk that is late
  (three times the median time a chunk of this download took): first answer wins;
- nothing (None) when nothing can start now, or NoUsableSource when a missing chunk has no usable
  holder, nothing is in flight and `stall_s` has passed without progress.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from elastic_mesh.transfer.chunk_dir import bitmap_has
from elastic_mesh.transfer.chunks import TransferError
from elastic_mesh.transfer.sources import SourcePicker

ENDGAME_MIN_S = 0.25    # a chunk in flight at least this long may be asked of a second source
ENDGAME_FIRST_S = 1.0   # ... before any chunk of the download has arrived to tell the usual pace
# How long a holder that has not delivered yet may keep a request before the seeder is asked for a chunk
# it claims. A new connection, its TLS handshake and the first answer take about 4 round trips (0.33 s on
# the `global` profile's 80 ms); a bogus holder's waiting streams cost a download about this much more
# (loopback, 1.2 MB: 11.05 s with the ordinary time-out, 1.05 s at the endgame's 1 s, 0.62 s at 0.5 s).
UNPROVEN_PATIENCE_S = 0.5


class NoUsableSource(TransferError):
    """A missing chunk that no usable source holds, with nothing in flight that could still bring it."""

    def __init__(self, index: int) -> None:
        super().__init__(f"chunk {index}: no usable source holds it")
        self.index = index


@dataclass(frozen=True)
class Request:
    """What a download stream sends next. chunks: one chunk's index, or the chunks of which the source
    sends whichever it sent least (a seeded request: wait_s 0; a standing one: held up to wait_s)."""

    chunks: int | tuple[int, ...]
    source: str
    wait_s: float = 0.0

    @property
    def index(self) -> int | None:
        """The chunk asked for, when it is one."""
        return self.chunks if isinstance(self.chunks, int) else None

    @property
    def standing(self) -> bool:
        return self.index is None and self.wait_s > 0

    @property
    def seeded(self) -> bool:
        return self.index is None and self.wait_s == 0


def endgame_patience(took: list[float]) -> float:
    """How long a chunk's request may be in flight before the endgame asks a second source too: three
    times the median time a chunk of this download has taken so far (a late one, not the usual pace)."""
    if not took:
        return ENDGAME_FIRST_S
    return max(ENDGAME_MIN_S, 3 * sorted(took)[len(took) // 2])


@dataclass
class DownloadSchedule:
    """The state of one download's scheduling. streams: requests at once; wait_s: a standing request's
    wait (0: none); streamed: answers come as streams (a seeder streams its share, peers relay over
    standing streams); stall_s: how long a download may make no progress before a chunk without a
    usable holder ends it."""

    chunks: int
    picker: SourcePicker
    streams: int = 1
    wait_s: float = 0.0
    streamed: bool = False
    stall_s: float = 0.0
    seed: int | None = None
    in_flight: dict[int, set[str]] = field(default_factory=dict)  # chunk -> sources asked for it
    asked_at: dict[int, float] = field(default_factory=dict)  # chunk -> when its (first) request went out
    took: list[float] = field(default_factory=list)  # seconds each chunk of this download took
    excluded: dict[int, set[str]] = field(default_factory=dict)  # chunk -> sources that failed it or lied
    seeding: int = 0  # seeded requests in flight (their chunk is known only when they answer)
    standing: set[str] = field(default_factory=set)  # peers holding one of this download's standing requests
    streamed_from: set[str] = field(default_factory=set)  # seeders streaming to this download now
    last_progress: float = 0.0

    def __post_init__(self) -> None:
        self.order = list(range(self.chunks))
        random.Random(self.seed).shuffle(self.order)

    def next(self, held: set[int], holders: dict[str, bytes | None], seeders: set[str], now: float) -> Request | None:
        """The next request (recorded as in flight), None if nothing can start now; NoUsableSource when
        the download cannot finish."""
        usable = [s for s in holders if self.picker.usable(s)]
        missing = [i for i in self.order if i not in held]
        fresh = [i for i in missing if i not in self.in_flight]
        # Endgame: every missing chunk is in flight; ask a second source for one that is late, first answer
        # wins. Only a late one: on links that every chunk shares, a duplicate of one on its way at the
        # usual pace costs the uplink it comes from (often the origin's) and this side's downlink as
        # much as the chunk itself, and ends no sooner.
        patience = endgame_patience(self.took)
        pool = fresh or [i for i in missing if len(self.in_flight.get(i, ())) == 1
                         and now - self.asked_at.get(i, now) >= patience]
        if self.streamed and self.wait_s and fresh and len(self.standing) < max(1, self.streams - 2):
            if (request := self._standing(usable, holders, seeders, fresh)) is not None:
                return request
        ranked = []
        for index in pool:
            holding = [s for s in usable if bitmap_has(holders[s], index) and s not in self.excluded.get(index, ())]
            have = [s for s in holding if s not in self.in_flight.get(index, ())
                    and not (self.streamed and (s in self.standing or s in self.streamed_from))]
            if any(not self.picker.suspected(s) for s in holding):
                # A suspect is asked only when nobody else holds the chunk: not even while the others
                # are busy (a seeder streaming to this member, say).
                have = [s for s in have if not self.picker.suspected(s)]
            others = [s for s in have if s not in seeders]
            if others or have:
                ranked.append((len(others), index, others or have, [s for s in have if s in seeders]))
        ranked.sort(key=lambda r: r[0])  # stable: rarest first, ties in this member's shuffled order
        for rarity, index, have, seeding in ranked:
            source = self.picker.pick(have)
            if source is None and seeding and not any(self.picker.proven(s) for s in have) and \
                    self._overdue(have, now, min(patience, UNPROVEN_PATIENCE_S)):
                # Its other holders are busy, none of them has delivered yet and one has kept a request
                # past UNPROVEN_PATIENCE_S (a holder that claims chunks and never answers looks like
                # this): the seeder, rather than waiting on them. Not sooner: a peer that answers at the
                # usual pace spares the seeder's uplink.
                source = self.picker.pick(seeding)
            if source is None:
                continue
            if rarity == 0 and source in seeders and fresh:
                # Only seeders hold it: let the seeder choose among every such chunk (super-seeding).
                self.seeding += 1
                if self.streamed:
                    self.streamed_from.add(source)
                return Request(tuple(i for r, i, h, _ in ranked if r == 0 and source in h), source)
            if index not in self.in_flight:
                self.asked_at[index] = now
            self.in_flight.setdefault(index, set()).add(source)
            return Request(index, source)
        if self.wait_s and fresh and (request := self._standing(usable, holders, seeders, fresh)) is not None:
            return request
        if not self.in_flight and not self.seeding and missing and not ranked and now - self.last_progress >= self.stall_s:
            raise NoUsableSource(missing[0])
        return None

    def _overdue(self, sources: list[str], now: float, patience: float) -> bool:
        """Whether any of `sources` holds a chunk request of this download older than `patience`."""
        asked = set(sources)
        return any(now - self.asked_at.get(i, now) >= patience for i, who in self.in_flight.items() if who & asked)

    def _standing(self, usable: list[str], holders: dict[str, bytes | None], seeders: set[str],
                  fresh: list[int]) -> Request | None:
        peers = [s for s in usable if holders[s] is not None and s not in seeders and s not in self.standing
                 and not self.picker.suspected(s)]
        if peers and (source := self.picker.pick(peers)) is not None:
            self.standing.add(source)
            return Request(tuple(fresh), source, self.wait_s)
        return None

    def settle(self, index: int | None, source: str, outcome: str, now: float) -> None:
        """A chunk's request to `source` ended: ok (stored, or a copy already held), busy, failed or
        corrupt (then `source` is not asked for this chunk again). index None: a multi-chunk request
        that brought nothing."""
        if index is not None and index in self.in_flight:
            self.in_flight[index].discard(source)
            if not self.in_flight[index]:
                del self.in_flight[index]
                self.asked_at.pop(index, None)
        if outcome in ("failed", "corrupt") and index is not None:
            self.excluded.setdefault(index, set()).add(source)
        elif outcome == "ok":
            self.last_progress = now

    def finished(self, request: Request) -> None:
        """A seeded or standing request is over (whatever it brought was settled chunk by chunk)."""
        if request.standing:
            self.standing.discard(request.source)
        elif request.seeded:
            self.seeding -= 1
            self.streamed_from.discard(request.source)

    def chunk_took(self, seconds: float) -> None:
        """A chunk asked for (not waited for at a peer) arrived after `seconds`: the endgame's measure."""
        self.took.append(seconds)
