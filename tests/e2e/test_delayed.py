"""The overlapped modes end to end. delayed: the outer step of round k is decided in a background thread
while round k+1 runs, and applied one round late. streaming: one fragment of the model at a time, every
H/F steps. Real coordinator, torchrun nodes, Gloo and SIGKILLs."""

from __future__ import annotations

import pytest

from prime.diloco.exchange import plan_pace
from tests.e2e.test_multinode import (
    assert_exactly_once,
    assert_identical,
    cluster,
    join_midway,
    node2_killed_in_the_exchange_of_step_2,
)

DELAYED = ["--diloco.mode", "delayed"]


def three_nodes_node1_faulty(c, fault: list[str], outer_steps: int) -> dict:
    """node0..node2 train, node1 with `fault`; all finish and stay identical. node0's outer-step records."""
    for name in ("node0", "node1", "node2"):
        c.start_node(name, fault if name == "node1" else None)
    assert c.wait_nodes(240) == {"node0": 0, "node1": 0, "node2": 0}, c.log("node1")[-3000:]
    assert_identical(c, ["node0", "node1", "node2"], range(1, outer_steps + 1))
    return c.outer_records("node0")


def test_a_paced_outer_step_leaves_room_in_its_share_for_its_plan_and_vote():
    """A share of 10 s between launches in a window of 12 s, paced over 0.9 of it: recent steps planned
    in 0.3 s and voted and committed in 0.7 s on average. That 1 s fits in the 1 s the pace leaves, so
    the transfer keeps its 9 s; it must end 1 s (the longest vote and commit) before the window does."""
    recent = [(0.2, 0.6), (0.5, 0.5), (0.2, 1.0)]
    pace = plan_pace(10.0, 0.9, 12.0, recent, now=100.0)
    assert pace.spread_s == pytest.approx(9.0) and pace.finish_by == pytest.approx(111.0)
    # Paced over the whole share, the transfer gives up the plan and the vote and commit, so the next
    # outer step need not queue behind this one.
    assert plan_pace(10.0, 1.0, 12.0, recent, now=0.0).spread_s == pytest.approx(9.0)
    assert plan_pace(10.0, 0.95, 12.0, [(0.6, 0.9)], now=0.0).spread_s == pytest.approx(8.5)
    # Overheads that would leave less than half the spread: the transfer keeps half.
    assert plan_pace(5.0, 0.8, 12.0, [(2.0, 3.0)], now=0.0).spread_s == pytest.approx(2.0)
    # Before any outer step was decided, a few WAN round trips are assumed.
    first = plan_pace(10.0, 0.9, 12.0, [], now=0.0)
    assert first.spread_s == pytest.approx(8.5) and first.finish_by == pytest.approx(11.0)


def test_delayed_nodes_stay_identical_and_read_exactly_once(tmp_path, corpus):
    """2 nodes × 2 local ranks (the background thread's own local group), 2 TCP streams per peer pair;
    each average applied as soon as it is decided (diloco.apply_early), which on loopback is a step or
    two after its launch rather than a whole round of 5 (inner steps slowed to 0.2 s): the local ranks
    must agree on the inner step at which they apply it. Only the node that launches last sees that
    short lag: a node that runs ahead by d steps (it started training later than the other: seen in CI)
    waits d steps more for the other's launch, and one ahead by ≥ 5 applies every average a whole round
    late, so its lead shrinks to 5 minus the exchange time and stays there (CI: [5, 5, 5, 5, 5] on node
    a). The lags are checked on both nodes."""
    extra = [*DELAYED, "--data.parts_per_file", "2", "--mesh.streams_per_peer", "2", "--diloco.apply_early", "true",
             "--chaos.step_delay_s", "0.2"]
    with cluster(tmp_path, corpus, 2, steps=30, nproc=2, extra=extra) as c:
        c.start_node("a")
        c.start_node("b")
        assert c.wait_nodes(240) == {"a": 0, "b": 0}, c.log("a")[-3000:]
        assert_identical(c, ["a", "b"], range(1, 7))
        lags = {}
        for name in ("a", "b"):
            records = c.outer_records(name)
            assert sorted(records) == [1, 2, 3, 4, 5, 6] and all(r["members"] == 2 for r in records.values())
            lags[name] = [records[k]["applied_after_steps"] for k in range(1, 6)]  # the 6th: the run's end waits
            assert all(1 <= lag <= 5 for lag in lags[name]), lags
        behind = min(lags, key=lambda name: sum(lags[name]))  # the node that launches last
        assert min(lags[behind]) < 5, lags
        assert f"applied {min(lags[behind])} steps late" in c.log(behind)
        # The run ends on the average: the last outer step is applied to the model too (both nodes' final
        # eval, on the same weights and data, is the same number).
        evals = [[r["eval_loss"] for r in c.metrics(n) if "eval_loss" in r][-1] for n in ("a", "b")]
        assert evals[0] == evals[1], evals
        losses = [r["loss"] for r in c.metrics("a") if "loss" in r]
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0
        assert_exactly_once(c, corpus, parts_per_file=2)


def test_delayed_kill_mid_all_reduce_keeps_the_round(tmp_path, corpus):
    """node2 dies between the phases of outer step 2's all-reduce, which runs in the background: the
    survivors retry it with the pseudo-gradients kept, while their inner steps go on (eager updates with
    the mixed estimate, whose others' share changes with the members; each average applied 3 steps
    after its launch, not a whole round of 5)."""
    with cluster(tmp_path, corpus, 3, extra=[*DELAYED, "--diloco.eager", "mixed", "--diloco.overlap_steps", "3"]) as c:
        node2_killed_in_the_exchange_of_step_2(c)
        assert "applied 3 steps late" in c.log("node0")
        assert_exactly_once(c, corpus)


def test_delayed_non_finite_round_is_refused_and_read_again(tmp_path, corpus):
    """node1's round-2 pseudo-gradient is NaN: the peers refuse it; node1 keeps none of that round's
    progress (nor of round 3, which followed the refused reading), and reads both again."""
    with cluster(tmp_path, corpus, 3, steps=25, extra=DELAYED) as c:
        records = three_nodes_node1_faulty(c, ["--chaos.nan_at_outer_step", "2"], outer_steps=5)
        assert records[2]["refused"] == ["node1"] and records[2]["members"] == 2, records[2]
        assert records[4]["members"] == 3, records  # contributing again once healthy
        assert "applied one round late" in c.log("node0")
        assert all(records[k]["applied_after_steps"] == 5 for k in range(1, 5)), records
        losses = [r["loss"] for r in c.metrics("node1") if "loss" in r]
        assert all(loss == loss for loss in losses), losses  # a NaN never reached its weights
        assert_exactly_once(c, corpus)


def test_delayed_join_takes_a_snapshot_and_contributes(tmp_path, corpus):
    c, late, caught, _ = join_midway(tmp_path, corpus, steps=100, after=2, extra=DELAYED)
    # One snapshot. A joiner still too slow for the round after it (its first inner steps, 2 cores shared by
    # the whole suite) is left out of that one and replays it: a catch-up without a snapshot, by design.
    assert caught[0]["snapshot_bytes"] > 0 and all(r["snapshot_bytes"] == 0 for r in caught[1:]), caught
    first = min(late)
    assert first == caught[-1]["caught_up_to"] + 1 and late[first]["members"] == 3, (first, caught, late[first])
    assert_identical(c, ["node0", "node1", "late"], range(first, 21))
    assert_exactly_once(c, corpus)


STREAMING = ["--diloco.mode", "streaming", "--diloco.inner_steps", "6", "--diloco.fragments", "3"]


def test_streaming_fragments_take_turns_and_nodes_stay_identical(tmp_path, corpus):
    """H=6, 3 fragments: one fragment's outer step every 2 inner steps, each overlapped for 4 steps (two
    fragments in flight at once), and paced over 80% of them (inner steps made 0.25 s slower, so there
    is a window to pace over)."""
    paced = ["--diloco.overlap_steps", "4", "--diloco.pace", "0.8", "--chaos.step_delay_s", "0.25"]
    with cluster(tmp_path, corpus, 3, steps=36, extra=[*STREAMING, *paced]) as c:
        for name in ("node0", "node1", "node2"):
            c.start_node(name)
        assert c.wait_nodes(240) == {n: 0 for n in ("node0", "node1", "node2")}, c.log("node0")[-3000:]
        records = c.outer_records("node0")
        assert sorted(records) == list(range(1, 19)), sorted(records)
        assert [records[k]["fragment"] for k in range(1, 7)] == [0, 1, 2, 0, 1, 2]
        # Each was applied while the next one was in flight (all but the last two, drained by the last step).
        assert all(records[k]["in_flight"] == 1 for k in range(1, 16)), [records[k]["in_flight"] for k in records]
        assert_identical(c, ["node0", "node1", "node2"], range(1, 19))
        # Each outer step moves about a third of the model.
        sent = [records[k]["bytes_sent"] for k in range(1, 4)]
        assert max(sent) < 0.5 * sum(sent), sent
        # Paced: a transfer loopback moves in milliseconds is spread over ~0.8 × 2 × 0.25 s.
        seconds = sorted(records[k]["allreduce_s"] for k in range(4, 18))
        assert seconds[len(seconds) // 2] > 0.25, seconds
        # ... and the kernel paced both of each node's connections (one per peer) as well as the bucket.
        assert all(records[k]["kernel_paced"] == 2 for k in range(4, 18)), [records[k]["kernel_paced"] for k in records]
        # Where each outer step's time went: the transfer holds the all-reduce, the rest is coordination.
        for k in range(1, 18):
            timings = records[k]["timings"]
            assert set(timings) == {"plan_s", "transfer_s", "vote_s", "queued_s", "settle_s"}, timings
            assert min(timings.values()) >= 0 and timings["transfer_s"] >= records[k]["allreduce_s"], (k, timings)
            assert records[k]["exchange_s"] >= timings["plan_s"] + timings["transfer_s"] + timings["vote_s"] - 0.01
        # The last outer step closes every fragment at once: the run ends on an average of all its work.
        assert records[18]["fragment"] is None and records[18]["bytes_sent"] > 0.9 * sum(sent), records[18]
        losses = [r["loss"] for r in c.metrics("node0") if "loss" in r]
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0
        assert_exactly_once(c, corpus)


def test_streaming_join_replays_fragment_updates(tmp_path, corpus):
    c, late, caught, _ = join_midway(tmp_path, corpus, steps=90, after=4, extra=STREAMING)
    assert caught[0]["replayed"] >= 1, caught  # fragment updates replayed
    # One snapshot; a joiner still too slow for the round after it replays that one too, without a snapshot
    # (by design; seen once in a full run under load: left out of round 22 after a 0.3 s wait, replayed 22-24).
    assert all(r["snapshot_bytes"] == 0 for r in caught[1:]), caught
    first = min(late)
    assert first == caught[-1]["caught_up_to"] + 1 and late[first]["members"] == 3, (first, caught)
    assert_identical(c, ["node0", "node1", "late"], range(first, 46))
    assert_exactly_once(c, corpus)


def test_streaming_refusal_with_fragments_in_flight_reads_them_again(tmp_path, corpus):
    """Two fragments in flight (τ = 4 steps, one launched every 2): node1's outer step 3 is 10,000× too
    large and refused by its peers. Step 4, launched while 3 was in flight, reported reading that starts
    where 3's ends, which is never committed: it goes out without node1's reading, and both windows are
    read again. The nodes stay identical and every document is read exactly once."""
    overlapped = [*STREAMING, "--diloco.overlap_steps", "4"]
    with cluster(tmp_path, corpus, 3, steps=24, extra=overlapped) as c:
        records = three_nodes_node1_faulty(c, ["--chaos.outlier_at_outer_step", "3"], outer_steps=12)
        assert records[3]["refused"] == ["node1"] and records[3]["members"] == 2, records[3]
        assert records[4]["members"] == 2 and records[4]["refused"] == [], records[4]  # withheld, not refused
        assert records[6]["members"] == 3, records  # contributing again
        assert_exactly_once(c, corpus)
