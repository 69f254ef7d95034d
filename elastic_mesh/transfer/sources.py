"""Which source to take the next chunk from: by measured throughput, with some exploration.

Each source's rate is the moving average of what its chunks measured (bytes over seconds, request
included), divided among the streams already waiting on it. A source never tried is tried first (its
rate is unknown, and unknown sources are how a swarm finds its fast peers); then, with probability
`explore`, a random one, so a source that was slow once is measured again. A source that fails or
sends bad bytes `max_failures` times, or is banned outright, is not used again by this download.

What a member learned in its earlier downloads comes in as `proven` (sources that delivered) and
`suspects` (sources that failed and never delivered: a holder that claims chunks and never answers).
A suspect is asked only when no other source holds the chunk, so a bogus holder costs the downloads
until a request of it fails (each the seeder's patience, schedule.py), not every download.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass


@dataclass
class SourceStats:
    rate: float | None = None  # bytes/s, moving average over its chunks
    in_flight: int = 0
    failures: int = 0
    banned: str = ""  # why, if it must not be used again
    bytes: int = 0
    busy_until: float = 0.0  # time.monotonic() before which it is not asked (its upload slots were full)


class SourcePicker:
    def __init__(self, streams_per_source: int = 2, max_failures: int = 3, explore: float = 0.1,
                 seed: int | None = None, proven: set[str] | frozenset[str] = frozenset(),
                 suspects: set[str] | frozenset[str] = frozenset()) -> None:
        self.streams_per_source, self.max_failures, self.explore = streams_per_source, max_failures, explore
        self.known_good, self.suspects = set(proven), set(suspects) - set(proven)
        self.stats: dict[str, SourceStats] = {}
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def _get(self, source: str) -> SourceStats:
        return self.stats.setdefault(source, SourceStats())

    def usable(self, source: str) -> bool:
        with self._lock:
            s = self._get(source)
            return not s.banned and s.failures < self.max_failures

    def proven(self, source: str) -> bool:
        """Whether `source` delivered: in this download, or in an earlier one of this member."""
        with self._lock:
            return source in self.known_good or self._get(source).rate is not None

    def suspected(self, source: str) -> bool:
        """Whether `source` failed an earlier download of this member without ever delivering."""
        with self._lock:
            return source in self.suspects and self._get(source).rate is None

    def pick(self, candidates: list[str]) -> str | None:
        """The source to ask next among `candidates` (those holding the chunk), or None if every usable
        one already has its streams busy. Marks it in flight: call done() or failed() after. A suspect
        is asked only when every candidate is one."""
        now = time.monotonic()
        with self._lock:
            trusted = [c for c in candidates if c not in self.suspects or self._get(c).rate is not None]
            candidates = trusted or candidates
            free = [c for c in candidates if not (s := self._get(c)).banned and s.failures < self.max_failures
                    and s.in_flight < self.streams_per_source and s.busy_until <= now]
            if not free:
                return None
            untried = [c for c in free if self.stats[c].rate is None and self.stats[c].in_flight == 0]
            if untried:
                choice = self._rng.choice(untried)
            elif self._rng.random() < self.explore:
                choice = self._rng.choice(free)
            else:
                def expected(c: str) -> float:
                    s = self.stats[c]
                    return (s.rate or 0.0) / (s.in_flight + 1)
                best = max(expected(c) for c in free)
                choice = self._rng.choice([c for c in free if expected(c) >= best * 0.999])
            self.stats[choice].in_flight += 1
            return choice

    def done(self, source: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            s = self._get(source)
            s.in_flight -= 1
            s.bytes += nbytes
            # Concurrent streams share the source's link: each measured its share, so the source's rate
            # is that times the streams it had.
            measured = nbytes / max(seconds, 1e-6) * (s.in_flight + 1)
            s.rate = measured if s.rate is None else 0.7 * s.rate + 0.3 * measured

    def failed(self, source: str) -> None:
        with self._lock:
            s = self._get(source)
            s.in_flight -= 1
            s.failures += 1

    def busy(self, source: str, back_off_s: float = 0.2) -> None:
        """Its upload slots were full: not a failure; it is not asked again for `back_off_s`."""
        with self._lock:
            s = self._get(source)
            s.in_flight -= 1
            s.busy_until = time.monotonic() + back_off_s * (0.5 + self._rng.random())

    def ban(self, source: str, why: str) -> None:
        with self._lock:
            self._get(source).banned = why

    def rates(self) -> dict[str, float | None]:
        with self._lock:
            return {c: s.rate for c, s in self.stats.items()}
