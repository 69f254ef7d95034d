"""Exactly-once data: the coordinator's ledger (real SQLite, real transactions) with the nodes' leased
streams over real shard files, through commits, refusals and deaths; and the audit that checks it."""

from __future__ import annotations

import json
import random

import pytest

from elastic_mesh.coordinator.leases import LedgerError, WorkLedger, parse_report
from elastic_mesh.coordinator.state import CoordinatorState
from prime.data.leased import LeasedSequenceStream
from prime.data.shards import make_shards
from prime.data.tokenizer import ByteTokenizer
from prime.tools.audit import audit, in_prime_words

SEQ_LEN = 32


@pytest.fixture
def shard_files(tmp_path):
    rng = random.Random(0)
    files = []
    for f in range(4):
        path = tmp_path / f"train-{f}.jsonl"
        with open(path, "w") as out:
            for d in range(rng.randint(15, 40)):
                text = "".join(rng.choice("abcdefgh \n") for _ in range(rng.randint(5, 120)))
                out.write(json.dumps({"id": f"f{f}-d{d}", "text": text}) + "\n")
        files.append(str(path))
    return files


class Worker:
    """One local rank of one node: a leased stream and the iterator the trainer would hold."""

    def __init__(self, ledger: WorkLedger, state: CoordinatorState, node: str, shards, interleave: int = 3) -> None:
        # The coordinator's fair share of spare shards as for 3 live one-rank nodes: over them and a joiner.
        self.node, self.ledger, self.state, self.share = node, ledger, state, len(shards) // 4
        self.stream = LeasedSequenceStream(shards, ByteTokenizer(), SEQ_LEN, "text", self._lease, worker=0,
                                           interleave=interleave, seed=7)
        self.samples = iter(self.stream)
        self.drawn = 0  # windows since the last commit or rewind

    def draw(self) -> None:
        assert next(self.samples).shape == (SEQ_LEN + 1,)
        self.drawn += 1

    def _lease(self, held, spare):
        with self.state.transaction():
            return self.ledger.lease(self.node, 0, held, share=self.share if spare else None)

    def commit(self, outer_step: int) -> int:
        ranges = parse_report({"data": self.stream.report()}, workers=1)["data"]
        with self.state.transaction():
            assert self.ledger.check(self.node, ranges) is None
            self.ledger.commit(outer_step, self.node, ranges)
        self.stream.committed()  # the iterator goes on where it is
        drawn, self.drawn = self.drawn, 0
        return drawn

    def rewind(self) -> None:
        self.stream.rewind()
        self.samples = iter(self.stream)
        self.drawn = 0


def fresh_ledger(tmp_path, shards: int) -> tuple[CoordinatorState, WorkLedger]:
    state = CoordinatorState(tmp_path / "coordinator.sqlite")
    ledger = WorkLedger(state.db, "data")
    with state.transaction():
        ledger.configure(shards)
    return state, ledger


def test_commits_refusals_and_deaths_keep_every_document_exactly_once(tmp_path, shard_files):
    shards = make_shards(shard_files, parts_per_file=2)
    state, ledger = fresh_ledger(tmp_path, len(shards))
    rng = random.Random(1)
    workers = [Worker(ledger, state, f"node{i}", shards) for i in range(3)]
    born, outcomes, committed_windows = 3, {"commit": 0, "refused": 0, "died": 0}, 0
    for step in range(1, 61):
        for w in workers:
            for _ in range(rng.randint(1, 12)):
                w.draw()
        for i, w in enumerate(workers):
            fate = rng.choices(["commit", "refused", "died"], [8, 1, 1])[0]
            outcomes[fate] += 1
            if fate == "commit":
                committed_windows += w.commit(step)
            elif fate == "refused":
                w.rewind()
            else:  # its uncommitted reading goes back to the pool; a fresh node takes its place
                with state.transaction():
                    ledger.release(w.node)
                workers[i] = Worker(ledger, state, f"node{born}", shards)
                born += 1
    assert min(outcomes.values()) > 0, outcomes
    report = audit(in_prime_words(ledger.log()), shards, ByteTokenizer())
    assert report.ok, report.summary()
    assert report.finished_passes >= 4 and report.documents > 100, report.summary()
    # Each committed window moved the cursor by seq_len tokens: the audit finds exactly those tokens.
    assert report.tokens == committed_windows * SEQ_LEN, report.summary()


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_overlapped_rounds_commit_late_and_still_read_exactly_once(tmp_path, shard_files, depth):
    """The overlapped modes: a round's reading is marked when it ends and committed (or refused) while
    later rounds read on, with up to `depth` rounds in flight (1: delayed; more: streaming with an
    overlap over H/F steps, the coordinator committing them in order). A refusal re-reads every round
    still in flight (the later ones went out without their reading), a death releases them all."""
    # Up to 3 rounds in flight keep finished shards leased until they commit, beside the 3 being read:
    # 24 shards for 3 workers.
    shards = make_shards(shard_files, parts_per_file=6)
    state, ledger = fresh_ledger(tmp_path, len(shards))
    rng = random.Random(2 + depth)
    workers = [Worker(ledger, state, f"node{i}", shards) for i in range(3)]
    in_flight: list[list[tuple]] = [[], [], []]  # per worker: (outer step, ranges, windows) of marked rounds
    born, outcomes, committed_windows = 3, {"commit": 0, "refused": 0, "died": 0}, 0
    for step in range(1, 61):
        for i in range(3):
            w = workers[i]
            for _ in range(rng.randint(1, 12)):
                w.draw()
            if len(in_flight[i]) == depth:  # the oldest round in flight is decided now
                marked_step, ranges, windows = in_flight[i].pop(0)
                fate = rng.choices(["commit", "refused", "died"], [8, 1, 1])[0]
                outcomes[fate] += 1
                if fate == "refused":
                    w.rewind()
                    in_flight[i].clear()
                    continue
                if fate == "died":
                    with state.transaction():
                        ledger.release(w.node)
                    workers[i] = Worker(ledger, state, f"node{born}", shards)
                    in_flight[i].clear()
                    born += 1
                    continue
                with state.transaction():
                    assert ledger.check(w.node, ranges) is None
                    ledger.commit(marked_step, w.node, ranges)
                w.stream.committed()  # to the oldest mark; the reading since goes on
                committed_windows += windows
            in_flight[i].append((step, parse_report({"data": w.stream.mark()}, workers=1)["data"], w.drawn))
            w.drawn = 0
    assert min(outcomes.values()) > 0, outcomes
    report = audit(in_prime_words(ledger.log()), shards, ByteTokenizer())
    assert report.ok, report.summary()
    assert report.documents > 100 and report.tokens == committed_windows * SEQ_LEN, report.summary()


def test_the_audit_catches_a_duplicate_and_a_gap(tmp_path, shard_files):
    shards = make_shards(shard_files, parts_per_file=1)
    state, ledger = fresh_ledger(tmp_path, len(shards))
    w = Worker(ledger, state, "a", shards)
    for step in range(1, 4):
        for _ in range(5):
            w.draw()
        w.commit(step)
    log = in_prime_words(ledger.log())
    assert audit(log, shards, ByteTokenizer()).ok
    duplicated = audit(log + [log[1]], shards, ByteTokenizer())
    assert not duplicated.ok and duplicated.chain_errors and duplicated.duplicated, duplicated.summary()
    gap = audit([log[0], log[2]], shards, ByteTokenizer())
    assert not gap.ok and gap.chain_errors and gap.partial, gap.summary()


def test_the_ledger_refuses_reports_that_do_not_match_it(tmp_path, shard_files):
    state, ledger = fresh_ledger(tmp_path, 2)
    with state.transaction():
        first = ledger.lease("a", 0, [])
        assert ledger.lease("a", 0, []) == first  # the answer to a retried request, not a second shard
        ledger.lease("b", 0, [])
        with pytest.raises(LedgerError, match="all 2 data items are leased"):
            ledger.lease("c", 0, [])
    entry = {"worker": 0, "item": first["item"], "pass": 0, "start": [], "end": [3, 7], "finished": False}
    assert ledger.check("a", parse_report({"data": [entry]}, 1)["data"]) is None
    assert "not leased to this node" in ledger.check("b", parse_report({"data": [entry]}, 1)["data"])
    assert "committed position" in ledger.check("a", parse_report({"data": [{**entry, "start": [1, 0]}]}, 1)["data"])
    with pytest.raises(LedgerError):
        parse_report({"data": [{**entry, "worker": 3}]}, 1)
    with pytest.raises(LedgerError):
        parse_report({"data": "not a list"}, 1)
    with state.transaction():
        assert ledger.release("a") == 1
        assert ledger.lease("c", 0, [])["item"] == first["item"]


def test_spare_items_stop_at_the_workers_share_and_when_none_is_free(tmp_path):
    state, ledger = fresh_ledger(tmp_path, 5)
    with state.transaction():
        mine = [ledger.lease("a", 0, [])["item"]]
        mine.append(ledger.lease("a", 0, mine, share=3)["item"])
        mine.append(ledger.lease("a", 0, mine, share=3)["item"])
        assert ledger.lease("a", 0, mine, share=3) == {"kind": "data", "item": None}  # holds its share
        assert ledger.lease("a", 0, mine[:2], share=3)["item"] == mine[2]  # a lost answer, answered again
        theirs = [ledger.lease("b", 0, [])["item"]]
        theirs.append(ledger.lease("b", 0, theirs, share=3)["item"])
        assert ledger.lease("b", 0, theirs, share=3)["item"] is None  # none free: no error for a spare
        with pytest.raises(LedgerError, match="all 5 data items are leased"):
            ledger.lease("c", 0, [])  # a worker's first item is not optional
    assert len(set(mine + theirs)) == 5


def test_roll_back_restores_the_cursors_of_an_earlier_step(tmp_path, shard_files):
    shards = make_shards(shard_files, parts_per_file=1)
    state, ledger = fresh_ledger(tmp_path, len(shards))
    w = Worker(ledger, state, "a", shards)
    snapshots = {}
    for step in range(1, 40):
        for _ in range(4):
            w.draw()
        w.commit(step)
        snapshots[step] = state.db.execute("SELECT item, pass, cursor FROM work_items ORDER BY item").fetchall()
    assert ledger.summary()["max_pass"] >= 1  # some shard was read to its end and leased again
    for step in (30, 12, 3):
        with state.transaction():
            ledger.roll_back(step)
        assert state.db.execute("SELECT item, pass, cursor FROM work_items ORDER BY item").fetchall() == snapshots[step]
        assert max(e["round"] for e in ledger.log()) == step and ledger.summary()["leased"] == 0


def test_nodes_and_ranks_read_distinct_windows(tmp_path, shard_files, corpus):
    """Within one pass no window is read twice: by two nodes' interleaved leased streams, or by two
    data-parallel ranks of one node."""
    from prime.data.loader import (
        DataConfig,
        PackedSequenceStream,
        train_and_eval_files,
        worker_shards,
    )

    shards = make_shards(shard_files, parts_per_file=2)
    state, ledger = fresh_ledger(tmp_path, len(shards))
    nodes = [Worker(ledger, state, f"node{i}", shards) for i in range(2)]
    read = [[tuple(next(w.samples).tolist()) for _ in range(40)] for w in nodes]
    held = [{h.shard for h in w.stream.held} for w in nodes]
    assert not held[0] & held[1] and min(map(len, held)) >= 2, held  # each reads several shards, none shared
    assert not set(read[0]) & set(read[1])
    train, _ = train_and_eval_files(DataConfig(path=str(corpus)))
    ranks = [PackedSequenceStream(worker_shards(DataConfig(), train, r, 2), ByteTokenizer(), SEQ_LEN, interleave=4)
             for r in range(2)]
    windows = [[tuple(w.tolist()) for w, _ in zip(stream, range(300))] for stream in ranks]
    assert not set(windows[0]) & set(windows[1])
