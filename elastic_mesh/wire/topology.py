"""Which order the all-reduce's ring should take, from link rates measured by the transfers themselves.

The gather phase of the all-reduce is a ring: every member forwards N-1 chunks to its right-hand
neighbour, all hops at once, so the ring moves at the rate of its slowest hop. Between continents a
few pairs of nodes can be several times slower than the rest (a congested route, a long lossy path
that caps a TCP stream); a ring that avoids them is that many times faster.

The scatter cannot avoid a slow route (every member sends a chunk to every other), but it sends
over slow routes at once, beside its other transfers, rather than in turn (steps.slow_peers).

Measurement is passive: the scatter phase already sends a chunk between every ordered pair of
members, and the receiver times each one (see steps.pairwise). Every member keeps what it
measured coming in, keyed by the peer's name so it survives a change of membership, smoothed over
all-reduces. At the next all-reduce every member puts its row in the header the members exchange
anyway; all then hold the same matrix and pick the same ring with the same deterministic code.

Choosing the ring that maximises its slowest hop is the bottleneck travelling-salesman problem
(NP-hard; PRIME solved the plain TSP exactly, exponential in N). `choose_ring` is polynomial: a binary
search over the N² measured rates for the highest t such that local search (move one member, swap
two, reverse a run; from the current ring and widest-neighbour tours) finds a ring with no hop below
t, then the same local search on the next-slowest hops. Each probe is O(N^3) per pass, O(N) passes.
"""

from __future__ import annotations

import math
import threading


def hop_rates(order: list[int], rates: list[list[float]]) -> list[float]:
    """The rate of every hop of the ring `order` (order[k] sends to order[k + 1])."""
    return [rates[order[k]][order[(k + 1) % len(order)]] for k in range(len(order))]


def _widest_neighbour(start: int, rates: list[list[float]]) -> list[int]:
    n = len(rates)
    order, left = [start], set(range(n)) - {start}
    while left:
        here = order[-1]
        nxt = max(sorted(left), key=lambda j: rates[here][j])  # sorted: ties go to the lowest rank
        order.append(nxt)
        left.remove(nxt)
    return order


def _moves(order: list[int]):
    """Every tour one move away: one member moved elsewhere, two swapped, a run reversed."""
    n = len(order)
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            moved = order[:i] + order[i + 1:]
            moved.insert(j, order[i])
            yield moved
            if i < j:
                swapped = list(order)
                swapped[i], swapped[j] = swapped[j], swapped[i]
                yield swapped
                yield order[:i] + order[i:j + 1][::-1] + order[j + 1:]


class _Budget:
    """Tours the search may still evaluate: bounds its cost whatever the rates (deterministically, so
    every member stops at the same tour)."""

    def __init__(self, evaluations: int) -> None:
        self.left = evaluations

    def take(self) -> bool:
        self.left -= 1
        return self.left >= 0


def _descend(order: list[int], cost, max_passes: int, budget: _Budget) -> list[int]:
    """First-improvement local search over _moves on cost (lower is better)."""
    best, best_cost = list(order), cost(order)
    for _ in range(max_passes):
        improved = False
        for candidate in _moves(best):
            if not budget.take():
                return best
            c = cost(candidate)
            if c < best_cost:
                best, best_cost, improved = candidate, c, True
                break
        if not improved:
            break
    return best


def _ring_above(threshold: float, starts: list[list[int]], rates: list[list[float]],
                max_passes: int, budget: _Budget) -> list[int] | None:
    """A ring with no hop slower than threshold, searched for by descending on the number of such hops."""
    slow = lambda o: sum(r < threshold for r in hop_rates(o, rates))  # noqa: E731
    for start in starts:
        found = _descend(start, slow, max_passes, budget)
        if slow(found) == 0:
            return found
    return None


def canonical(order: list[int]) -> list[int]:
    """The same ring written from member 0 (a ring has no start; this makes equal rings compare equal)."""
    k = order.index(0)
    return order[k:] + order[:k]


def choose_ring(rates: list[list[float]], current: list[int], hysteresis: float = 1.15,
                max_passes: int | None = None) -> list[int]:
    """A ring over members 0..N-1 whose slowest hop is as fast as this heuristic finds, or `current`
    unless the new ring's slowest hop is `hysteresis` × faster (measurements are noisy; a ring that
    changes at every all-reduce would chase noise). rates[i][j]: bytes/s from i to j; no NaNs."""
    n = len(rates)
    if n <= 2:
        return list(current)
    passes, budget = max_passes or 4 * n, _Budget(4_000_000 // n)  # ≈ 4M hop look-ups: < 1 s for N = 32
    widest = sorted((_widest_neighbour(s, rates) for s in range(n)), key=lambda o: -min(hop_rates(o, rates)))
    starts = [list(current)] + widest[:3]
    # Binary search on the slowest hop over the distinct rates: is there a ring with every hop at least t?
    levels = sorted({rates[i][j] for i in range(n) for j in range(n) if i != j})
    best = max(starts, key=lambda o: min(hop_rates(o, rates)))
    lo, hi = levels.index(min(hop_rates(best, rates))), len(levels) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        found = _ring_above(levels[mid], [best] + starts, rates, passes, budget)
        if found is None:
            hi = mid - 1
        else:
            best, lo = found, levels.index(min(hop_rates(found, rates)))
    # With the slowest hop fixed, make the next-slowest ones as fast as possible too (never lowers it).
    best = _descend(best, lambda o: [-r for r in sorted(hop_rates(o, rates))], passes, _Budget(4_000_000 // n))
    if min(hop_rates(best, rates)) > hysteresis * min(hop_rates(current, rates)):
        return canonical(best)
    return list(current)


class LinkEstimates:
    """What this member measured coming in from each peer (bytes/s, smoothed), and the ring it last used.
    Keyed by peer name, so estimates outlive a change of membership. Thread-safe: an all-reduce in a
    background thread and one in the main thread may share it."""

    def __init__(self, smoothing: float = 0.5) -> None:
        self.smoothing = smoothing
        self._incoming: dict[str, float] = {}
        self._ring: list[str] = []
        self._lock = threading.Lock()

    def observe(self, peer: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or not (seconds > 0) or not math.isfinite(seconds):
            return
        rate = nbytes / seconds
        with self._lock:
            old = self._incoming.get(peer)
            self._incoming[peer] = rate if old is None else self.smoothing * rate + (1 - self.smoothing) * old

    def incoming(self, peers: list[str]) -> list[float]:
        """This member's row for the current members: 0 where nothing was measured yet."""
        with self._lock:
            return [self._incoming.get(p, 0.0) for p in peers]

    def last_ring(self, peers: list[str]) -> list[int]:
        """The ring last used, as ranks among `peers`: members it did not have are appended in rank order."""
        with self._lock:
            known = [peers.index(p) for p in self._ring if p in peers]
        return known + [r for r in range(len(peers)) if r not in known]

    def used(self, ring: list[int], peers: list[str]) -> None:
        with self._lock:
            self._ring = [peers[r] for r in ring]


def rate_matrix(rows: list[list[float]]) -> list[list[float]] | None:
    """The full matrix rates[i][j] (from i to j) from every member's row of incoming rates (rows[j][i]),
    with unmeasured or nonsensical entries set to the median of the measured ones; None if nothing
    was measured (keep the current ring)."""
    n = len(rows)
    measured = sorted(v for j in range(n) for i in range(n) if i != j
                      for v in [rows[j][i]] if math.isfinite(v) and v > 0)
    if not measured:
        return None
    fill = measured[len(measured) // 2]
    return [[0.0 if i == j else (rows[j][i] if math.isfinite(rows[j][i]) and rows[j][i] > 0 else fill)
             for j in range(n)] for i in range(n)]


def describe_ring(ring: list[int], rates: list[list[float]] | None, names: list[str]) -> str:
    """'a -> c -> b (slowest hop 3.6 Mbit/s)' for logs."""
    text = " -> ".join(names[r] for r in ring)
    if rates:
        text += f" (slowest hop {min(hop_rates(ring, rates)) * 8 / 1e6:.1f} Mbit/s measured)"
    return text
