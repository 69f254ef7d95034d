"""Choosing the all-reduce's ring from link rates (elastic_mesh/wire/topology.py): pure functions, no network."""

from __future__ import annotations

import itertools
import random

from elastic_mesh.wire.topology import (
    LinkEstimates,
    choose_ring,
    hop_rates,
    rate_matrix,
)


def _best_bottleneck(rates):
    """Exact, by trying every ring (exponential: only for checking the heuristic on small N)."""
    n = len(rates)
    return max(min(hop_rates([0, *p], rates)) for p in itertools.permutations(range(1, n)))


def test_ring_avoids_slow_routes_between_continents():
    # Two nodes each in three regions; US <-> Asia routes are 10x slower than the rest.
    region = ["us", "us", "asia", "asia", "eu", "eu"]
    rates = [[0.0 if i == j else (1.0 if {region[i], region[j]} == {"us", "asia"} else 10.0)
              for j in range(6)] for i in range(6)]
    assert min(hop_rates(list(range(6)), rates)) == 1.0  # rank order crosses the slow routes
    ring = choose_ring(rates, list(range(6)))
    assert min(hop_rates(ring, rates)) == 10.0
    assert sorted(ring) == list(range(6)) and ring[0] == 0


def test_heuristic_matches_the_exact_bottleneck_closely_on_random_rates():
    rng = random.Random(7)
    ratios = []
    for _ in range(60):
        n = rng.randint(3, 7)
        rates = [[0.0 if i == j else rng.choice([1, 2, 5, 10]) * rng.uniform(0.9, 1.1) for j in range(n)]
                 for i in range(n)]
        ring = choose_ring(rates, list(range(n)), hysteresis=1.0)
        ratios.append(min(hop_rates(ring, rates)) / _best_bottleneck(rates))
    assert min(ratios) >= 0.85, f"worst ratio to the exact bottleneck: {min(ratios):.3f}"
    assert sum(r >= 0.999 for r in ratios) >= 0.9 * len(ratios)


def test_small_gains_keep_the_current_ring():
    rates = [[0.0 if i == j else 10.0 for j in range(4)] for i in range(4)]
    rates[0][1] = 9.5  # rank order's slowest hop is only 5% below the best ring's
    assert choose_ring(rates, [0, 1, 2, 3]) == [0, 1, 2, 3]
    rates[0][1] = 2.0
    assert choose_ring(rates, [0, 1, 2, 3]) != [0, 1, 2, 3]


def test_estimates_are_smoothed_keyed_by_name_and_survive_new_members():
    links = LinkEstimates(smoothing=0.5)
    links.observe("b", 100, 1.0)
    links.observe("b", 300, 1.0)
    links.observe("c", 0, 1.0)  # nothing moved: no estimate
    assert links.incoming(["a", "b", "c"]) == [0.0, 200.0, 0.0]
    links.used([2, 0, 1], ["a", "b", "c"])
    # A member joined and one left: the known ones keep their order, the new one comes last.
    assert links.last_ring(["c", "d", "a"]) == [0, 2, 1]


def test_rate_matrix_fills_gaps_with_the_median_and_needs_some_measurement():
    assert rate_matrix([[0.0, 0.0], [0.0, 0.0]]) is None
    rows = [[0.0, 4.0, 2.0], [float("nan"), 0.0, 6.0], [8.0, -1.0, 0.0]]  # rows[j][i]: j heard from i
    rates = rate_matrix(rows)
    assert rates[1][0] == 4.0 and rates[0][2] == 8.0 and rates[2][1] == 6.0
    assert rates[0][1] == 6.0 and rates[1][2] == 6.0  # nan and -1: the median of 2, 4, 6, 8 (upper)


def test_members_agree_on_rank_order_when_one_does_not_follow_links_or_member_0_sends_nonsense():
    import torch

    from elastic_mesh.wire.collectives import _agree_on_ring, header_size

    world = 4
    slow = [[0.0 if i == j else (1.0 if {i, j} == {0, 1} else 10.0) for i in range(world)] for j in range(world)]

    def headers(follows, ring):
        return [torch.tensor([1, 1, 1, 100, float(follows[j]), *slow[j], *ring, 0.0], dtype=torch.float32)
                for j in range(world)]

    assert all(h.numel() == header_size(world) for h in headers([1] * 4, range(4)))
    ring, rates = _agree_on_ring(headers([1] * 4, range(4)), world)
    assert (ring[0], ring[1]) != (0, 1) and rates is not None  # follows links: the slow hop is avoided
    assert _agree_on_ring(headers([1, 1, 0, 1], range(4)), world) == ([0, 1, 2, 3], None)
    for nonsense in ([float("nan"), 1, 2, 3], [0, 0, 1, 2], [0, 1, 2, 1e12]):
        ring, _ = _agree_on_ring(headers([1] * 4, nonsense), world)
        assert sorted(ring) == [0, 1, 2, 3]


def test_slow_peers_are_the_ends_of_slow_routes_in_either_direction():
    from elastic_mesh.wire.collectives import slow_peers

    rates = [[0.0 if i == j else 10.0 for j in range(4)] for i in range(4)]
    rates[0][1] = 2.0  # one direction is enough
    assert slow_peers(0, rates) == {1} and slow_peers(1, rates) == {0}
    assert slow_peers(2, rates) == set() and slow_peers(0, None) == set()
