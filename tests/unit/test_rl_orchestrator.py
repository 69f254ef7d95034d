"""The orchestrator's rules, in one process with real parts: a real digit policy (two versions), its
TOPLOC thresholds from the real calibration command, the real verifier and engine. Only the version
store is local (the broadcast that fills it in a run is tested in tests/e2e/test_rl.py)."""

from __future__ import annotations

import copy
import subprocess
import sys
import threading
import time

import pytest
import torch
from transformers import AutoTokenizer

from prime.inference.engine import GenerationRequest
from prime.inference.hf_engine import HFEngine, eos_id_of, load_hf_policy
from prime.inference.sampling import SamplingParams
from prime.rl.environments.reverse import ReverseConfig, ReverseDigits
from prime.rl.orchestrator.config import OrchestratorConfig
from prime.rl.orchestrator.core import Orchestrator
from prime.rl.orchestrator.run_store import RunStore
from prime.rl.policy import new_digit_policy
from elastic_mesh.control.http import Refused
from prime.rl.worker.session import to_wire
from prime.testing.rogue_worker import answer_swap
from prime.verify.thresholds import ToplocThresholds
from prime.verify.verifier import Verifier
from prime.verify.proof import proof_observer


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    directory = new_digit_policy(tmp_path_factory.mktemp("rl") / "policy", seed=0)
    subprocess.run([sys.executable, "-m", "prime.verify.calibrate", "--model", str(directory), "--threads", "1",
                    "--batch-sizes", "8", "--rollouts", "16", "--max-tokens", "8", "--margin", "16"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return directory


class LocalVersions:
    """What the orchestrator asks of its version store, over models held in memory."""

    def __init__(self, directory) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self.thresholds = ToplocThresholds.load(directory)
        self.models: dict[int, torch.nn.Module] = {}
        self.newest = self.announced = -1
        self.on_new = self.on_announced = lambda version: None

    def add(self, version: int, model) -> None:
        self.models[version] = model
        self.newest = self.announced = max(self.newest, version)
        self.on_new(version)

    def verifier(self, version: int) -> Verifier:
        model = self.models[version]
        return Verifier(model, self.thresholds, eos_id_of(model), 64)

    def model(self, version: int):
        return self.models[version]

    def allowed_dtypes(self) -> list[str] | None:
        return list(self.thresholds.limits) if self.newest >= 0 else None

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


def _orchestrator(policy, **settings) -> tuple[Orchestrator, LocalVersions, list[dict]]:
    versions = LocalVersions(policy)
    versions.add(0, load_hf_policy(policy))
    config = OrchestratorConfig(**{"env": ReverseConfig(), "group_size": 4, "prompts_per_step": 4,
                                   "prompts_per_lease": 2, "poll_s": 0.5, **settings})
    events: list[dict] = []
    return Orchestrator(config, ReverseDigits(config.env), versions, events.append), versions, events


def _work(orchestrator: Orchestrator, versions: LocalVersions, lease: dict, tamper=None) -> dict:
    """What an honest worker (or one with `tamper`) sends back for a lease."""
    model = versions.model(lease["version"])
    engine = HFEngine(model, pad_id=versions.tokenizer.pad_token_id,
                      observer=proof_observer(versions.thresholds.proof))
    sampling = SamplingParams.model_validate(lease["sampling"])
    requests = [GenerationRequest(r["prompt"], r["seed"], sampling) for r in lease["requests"]]
    completions = engine.generate(requests)
    if tamper:
        completions = tamper(requests, completions, engine)
    return {"lease": lease["lease"], "completions": [to_wire(c, "float32") for c in completions]}


def test_leases_batches_and_returned_work(policy):
    orchestrator, versions, events = _orchestrator(policy, async_level=1, lease_s=0.3)
    first = orchestrator.lease("w1", held=0)
    assert first["status"] == "ok" and len(first["requests"]) == 2 * 4
    assert len({r["seed"] for r in first["requests"]}) == 8  # each sample its own seed, drawn by the orchestrator
    orchestrator.lease("w2", held=0)  # w2 dies with this lease
    threading.Event().wait(0.4)
    orchestrator.expire()
    assert orchestrator.counters.leases_expired == 2 and not orchestrator.leases
    assert orchestrator.submit("w1", _work(orchestrator, versions, first))["status"] == "expired"  # too late
    again = orchestrator.lease("w1", held=0)
    assert [r["prompt"] for r in again["requests"]] == [r["prompt"] for r in first["requests"]]  # returned first
    assert orchestrator.submit("w1", _work(orchestrator, versions, again))["status"] == "accepted"
    numbers = set()
    while orchestrator.next_step < 2:
        lease = orchestrator.lease("w1", held=0)
        assert lease["status"] == "ok", lease
        assert orchestrator.submit("w1", _work(orchestrator, versions, lease))["status"] == "accepted"
        if len(orchestrator.ready) >= 4:
            batch = orchestrator.batch(orchestrator.next_step)
            assert batch["status"] == "ok" and all(r["version"] == 0 for r in batch["rows"])
            numbers.update(batch["stats"]["prompt_numbers"])
    assert len(numbers) == 8  # every prompt in at most one batch...
    assert orchestrator.batch(1) is orchestrator.batches[1]  # ...and a batch asked again is the same batch
    assert [e["step"] for e in events if e["event"] == "batch"] == [0, 1]
    # async level 1: the next batch is step 2, so version 0 can no longer serve it; the worker holds the
    # newest version this side heard of, so it is held here until a newer one is announced (poll_s), not
    # told to fetch what it holds (it would ask again at once: CI saw 200 requests in 0.1 s)
    asked = time.monotonic()
    assert orchestrator.lease("w1", held=0) == {"status": "wait"}
    assert time.monotonic() - asked >= 0.5
    versions.add(1, copy.deepcopy(versions.model(0)))
    assert orchestrator.lease("w1", held=0) == {"status": "fetch", "version": 1}


def test_a_batch_says_where_its_time_went(policy):
    """Lease -> arrived -> verified -> batched, and the trainer's wait, as the benchmark reads them."""
    orchestrator, versions, events = _orchestrator(policy, async_level=1)
    leases = [orchestrator.lease("w1", held=0) for _ in range(2)]
    works = [_work(orchestrator, versions, lease) for lease in leases]
    built: list[dict] = []
    trainer = threading.Thread(target=lambda: built.append(orchestrator.batch(0)))
    trainer.start()  # the trainer asks before the rollouts are back...
    threading.Event().wait(0.3)
    for work in works:  # ...and they arrive at least 0.3 s after their leases
        assert orchestrator.submit("w1", work)["status"] == "accepted"
    trainer.join(5)
    stats = built[0]["stats"]
    assert stats["leased_to_arrived_s"] >= 0.3
    assert 0 <= stats["arrived_to_verified_s"] < 5 and 0 <= stats["verified_to_batch_s"] < 5
    assert 0.3 <= stats["asked_to_built_s"] < 5
    assert [e["asked_to_built_s"] for e in events if e["event"] == "batch"] == [stats["asked_to_built_s"]]


def test_rollouts_older_than_the_async_level_are_dropped_and_the_worker_told_to_fetch(policy):
    orchestrator, versions, _ = _orchestrator(policy, async_level=0)
    lease = orchestrator.lease("w1", held=0)
    versions.add(1, copy.deepcopy(versions.model(0)))
    orchestrator.next_step = 1  # the trainer has moved on: batch 1 takes version >= 1 at async level 0
    answer = orchestrator.submit("w1", _work(orchestrator, versions, lease))
    assert answer == {"status": "stale", "version": 1}
    assert orchestrator.counters.rollouts_stale == 8 and not orchestrator.ready
    assert orchestrator.lease("w1", held=0) == {"status": "fetch", "version": 1}
    again = orchestrator.lease("w1", held=1)
    assert again["status"] == "ok" and again["version"] == 1
    assert {tuple(r["prompt"]) for r in again["requests"]} >= {tuple(r["prompt"]) for r in lease["requests"][:4]}


def test_a_cheating_worker_is_evicted_and_none_of_its_rollouts_enters_a_batch(policy):
    orchestrator, versions, events = _orchestrator(policy, async_level=2)
    honest = orchestrator.lease("rogue", held=0)
    assert orchestrator.submit("rogue", _work(orchestrator, versions, honest))["status"] == "accepted"
    cheat = orchestrator.lease("rogue", held=0)
    pending = orchestrator.lease("rogue", held=0)
    with pytest.raises(Refused, match="evicted: .*sampling"):
        orchestrator.submit("rogue", _work(orchestrator, versions, cheat, tamper=answer_swap))
    assert not orchestrator.ready and pending["lease"] not in orchestrator.leases  # its earlier groups and leases too
    assert orchestrator.counters.rollouts_rejected == 16
    with pytest.raises(Refused, match="evicted"):
        orchestrator.lease("rogue", held=0)
    with pytest.raises(Refused, match="evicted"):
        orchestrator.submit("rogue", _work(orchestrator, versions, pending))
    assert [e["worker"] for e in events if e["event"] == "evicted"] == ["rogue"]
    # a second submission verified beside the first (CI saw two) rejects its rollouts, evicts nobody again
    orchestrator._evict_worker("rogue", 8, "16 of 16 rollouts failed verification")
    assert orchestrator.counters.workers_evicted == 1 and orchestrator.counters.rollouts_rejected == 24
    assert [e["worker"] for e in events if e["event"] == "evicted"] == ["rogue"]


def test_one_failed_rollout_is_dropped_with_its_lease_and_a_run_of_them_evicts(policy):
    """Issue 51, evidence over time: a submission with one failed rollout among 8 (what an honest worker's
    calibration tail looks like) is refused and its prompts requeued, the worker kept; a worker failing one
    in 8 every time is evicted at its 7th such submission (CUSUM at the defaults), and one that fails 2 of 8
    at its 2nd. None of those rollouts enters a batch."""
    import dataclasses

    def one_off(requests, completions, engine, bad=1):
        return [dataclasses.replace(c, logprobs=[x - 0.01 for x in c.logprobs]) if i < bad else c
                for i, c in enumerate(completions)]
    orchestrator, versions, events = _orchestrator(policy, prompts_per_lease=2, async_level=8)
    answers = []
    for _ in range(7):
        lease = orchestrator.lease("flaky", held=0)
        try:
            answers.append(orchestrator.submit("flaky", _work(orchestrator, versions, lease, tamper=one_off)))
        except Refused as e:
            answers.append({"status": "evicted", "detail": str(e)})
    assert [a["status"] for a in answers] == ["rejected"] * 6 + ["evicted"], answers
    assert answers[0]["evidence"] == pytest.approx(6.21 - 7 * 0.69, abs=0.02) and "logprobs" in answers[0]["detail"]
    assert "evidence" in answers[-1]["detail"] and not orchestrator.ready
    assert orchestrator.counters.of("flaky").rejected == 7 * 8
    two = lambda requests, completions, engine: one_off(requests, completions, engine, bad=2)  # noqa: E731
    answers = []
    for _ in range(2):
        lease = orchestrator.lease("worse", held=0)
        try:
            answers.append(orchestrator.submit("worse", _work(orchestrator, versions, lease, tamper=two))["status"])
        except Refused:
            answers.append("evicted")
    assert answers == ["rejected", "evicted"]
    # An honest worker meanwhile: accepted, its groups kept.
    lease = orchestrator.lease("honest", held=0)
    assert orchestrator.submit("honest", _work(orchestrator, versions, lease))["status"] == "accepted"
    assert orchestrator.counters.of("honest").evidence == 0.0 and len(orchestrator.ready) == 2


def test_malformed_submissions_evict_without_reaching_the_verifier(policy):
    orchestrator, versions, _ = _orchestrator(policy)
    lease = orchestrator.lease("w", held=0)
    body = _work(orchestrator, versions, lease)
    body["completions"][0]["logprobs"] = ["nan"]
    with pytest.raises(Refused, match="malformed submission: logprobs"):
        orchestrator.submit("w", body)


def test_the_dtype_is_the_tokens_not_the_submissions(policy):
    """A float32 worker labelling its rollouts bfloat16 (to be held to bfloat16's looser limits: issue 51) is
    evicted as malformed before the verifier runs; a worker admitted as a dtype the run was not calibrated
    for gets no lease, told why (this policy was calibrated for float32 only)."""
    orchestrator, versions, _ = _orchestrator(policy)
    lease = orchestrator.lease("w", held=0, dtype="float32")
    body = _work(orchestrator, versions, lease)
    for entry in body["completions"]:
        entry["compute_dtype"] = "bfloat16"
    with pytest.raises(Refused, match="claim compute dtype bfloat16, but this worker's token admits it as a "
                                      "float32 worker"):
        orchestrator.submit("w", body, dtype="float32")
    assert orchestrator.counters.of("w").verify_s == 0  # refused before any verification
    with pytest.raises(Refused, match="admits a bfloat16 worker, but this run's policy was calibrated for float32"):
        orchestrator.lease("bf16", held=0, dtype="bfloat16")


def test_empty_and_too_long_prompts_are_refused_up_front_and_the_verifier_answers_them(policy):
    """Issue 51: an empty prompt made the verifier raise, and a prompt longer than the context minus
    max_tokens got honest rollouts rejected. The orchestrator now never leases them (counted, logged), and
    the verifier gives an empty prompt a verdict."""
    from prime.inference.engine import Completion
    from prime.rl.environments.base import Task
    from prime.verify.verifier import Claim
    orchestrator, versions, _ = _orchestrator(policy, prompts_per_lease=2)
    context = versions.model(0).config.max_position_embeddings
    usable = [Task("ok-1", "123", "321"), Task("ok-2", "78", "87")]
    stream = iter([Task("empty", "", ""), Task("long", "1" * context, ""), usable[0],
                   Task("also-long", "9" * (context - orchestrator.sampling.max_tokens + 1), ""), usable[1]])
    orchestrator.prompts.tasks = stream
    lease = orchestrator.lease("w", held=0)
    assert [versions.decode(r["prompt"]) for r in lease["requests"][::4]] == ["123", "78"]
    assert orchestrator.totals()["prompts_refused"] == 3 and orchestrator.prompts.drawn == 5
    orchestrator.prompts.tasks = iter([Task(f"e{i}", "", "") for i in range(2000)])
    with pytest.raises(Refused, match="all refused"):
        orchestrator.lease("w", held=0)
    verifier = versions.verifier(0)
    [verdict] = verifier.verify([Claim([], 1, orchestrator.sampling, Completion([5], [-0.1], "length", b"", "float32"))])
    assert not verdict.accepted and "empty prompt" in verdict.reason


def test_a_restarted_orchestrator_continues_the_run_and_uses_no_prompt_twice(policy, tmp_path):
    import json

    orchestrator, versions, _ = _orchestrator(policy, async_level=2)
    orchestrator.store = RunStore(tmp_path)
    numbers: list[int] = []
    texts: list[tuple] = []
    while orchestrator.next_step < 2:
        lease = orchestrator.lease("w1", held=0)
        orchestrator.submit("w1", _work(orchestrator, versions, lease))
        if len(orchestrator.ready) >= 4:
            batch = orchestrator.batch(orchestrator.next_step)
            numbers += batch["stats"]["prompt_numbers"]
            texts += [tuple(r["prompt"]) for r in batch["rows"]]
    with pytest.raises(Refused):  # an eviction is saved too
        rogue = orchestrator.lease("rogue", held=0)
        orchestrator.submit("rogue", _work(orchestrator, versions, rogue, tamper=answer_swap))
    in_flight = orchestrator.lease("w1", held=0)  # leased when the orchestrator dies: skipped
    state = RunStore(tmp_path).load()

    again, versions2, records = _orchestrator(policy, async_level=2)
    assert again.restore(state) == 2  # the rogue's returned prompts (w1's lease in flight took the same two)
    # Stopped between saving batch 1 and writing its record: the restart writes it; once, never twice.
    again.record_unrecorded_batch({0, 1})
    assert records == []
    again.record_unrecorded_batch({0})
    assert [(r["event"], r["step"], r["prompt_numbers"]) for r in records] == [
        ("batch", 1, orchestrator.batches[1]["stats"]["prompt_numbers"])]
    records.clear()
    assert again.start == 1 and again.next_step == 2 and again.batch(1) == json.loads(json.dumps(orchestrator.batches[1]))
    assert again.counters.rollouts_accepted == orchestrator.counters.rollouts_accepted
    with pytest.raises(Refused, match="evicted"):
        again.lease("rogue", held=0)
    assert again.submit("w1", _work(orchestrator, versions, in_flight))["status"] == "expired"  # from before
    before, texts = set(texts), []
    while again.next_step < 3:  # version 0 serves steps up to 0 + async level
        lease = again.lease("w1", held=0)
        assert lease["lease"].startswith("w1-1-"), lease["lease"]
        assert again.submit("w1", _work(again, versions2, lease))["status"] == "accepted"
        if len(again.ready) >= 4:
            batch = again.batch(again.next_step)
            numbers += batch["stats"]["prompt_numbers"]
            texts += [tuple(r["prompt"]) for r in batch["rows"]]
    assert len(numbers) == len(set(numbers)) == 12 and min(numbers[8:]) > max(numbers[:8])
    assert texts and not before & set(texts)  # the task stream went on past what the first start drew


def test_the_batches_a_trainer_may_ask_again_are_kept_and_survive_a_restart(policy, tmp_path):
    """A trainer that checkpoints every 3 steps asks for 4 batches kept: after a restart it asks again for
    any of the last 4 it was given, from a restarted orchestrator too; older ones are gone (409). Each
    batch is written once, to a file of its own; state.json names them and stays small."""
    import json

    orchestrator, versions, _ = _orchestrator(policy, async_level=8)
    orchestrator.store = RunStore(tmp_path)
    written: list[int] = []
    save_batch = orchestrator.store.save_batch
    orchestrator.store.save_batch = lambda step, batch: (written.append(step), save_batch(step, batch))
    with pytest.raises(Refused, match="between 2 and"):
        orchestrator.batch(0, keep=1)
    while orchestrator.next_step < 6:
        lease = orchestrator.lease("w1", held=0)
        assert orchestrator.submit("w1", _work(orchestrator, versions, lease))["status"] == "accepted"
        if len(orchestrator.ready) >= 4:
            orchestrator.batch(orchestrator.next_step, keep=4)
    assert sorted(orchestrator.batches) == [2, 3, 4, 5]
    with pytest.raises(Refused, match="only the last 4"):
        orchestrator.batch(1, keep=4)
    assert written == [0, 1, 2, 3, 4, 5]  # once each
    assert sorted(p.name for p in (tmp_path / "batches").iterdir()) == [f"{s:08d}.json" for s in (2, 3, 4, 5)]
    state_bytes = (tmp_path / "state.json").stat().st_size
    assert state_bytes < min(p.stat().st_size for p in (tmp_path / "batches").iterdir())
    again, _, _ = _orchestrator(policy, async_level=8)
    again.restore(RunStore(tmp_path).load())
    assert again.batch(2, keep=2) == json.loads(json.dumps(orchestrator.batches[2]))  # kept as the trainer said
    assert again.batches_kept == 4
    (tmp_path / "batches" / "00000003.json").unlink()
    with pytest.raises(RuntimeError, match="names batch 3"):
        RunStore(tmp_path).load()


def test_a_worker_gets_work_on_a_version_announced_before_the_orchestrator_has_loaded_it(policy):
    orchestrator, versions, _ = _orchestrator(policy, async_level=0)
    versions.announced = 1  # the coordinator announced version 1; this side is still downloading it
    orchestrator.next_step = 1
    assert orchestrator.lease("w1", held=0) == {"status": "fetch", "version": 1}
    lease = orchestrator.lease("w1", held=1)  # the worker got it first: it is given work at once
    assert lease["status"] == "ok" and lease["version"] == 1
    assert orchestrator.lease("w2", held=2)["status"] == "wait"  # never announced: no work on it
    versions.add(1, copy.deepcopy(versions.model(0)))  # loaded here: its rollouts can be verified
    assert orchestrator.submit("w1", _work(orchestrator, versions, lease))["status"] == "accepted"


def test_a_worker_waiting_for_work_on_its_version_is_sent_to_a_newer_one_that_has_work(policy):
    """Its lease request names the version it held when it asked; once nothing more is wanted from that
    one but a newer version is announced with work, the waiting request is granted work on the newer one
    at once (the worker's follower is most likely loading it) instead of waiting for the next batch to
    free work for the old."""
    orchestrator, versions, _ = _orchestrator(policy, async_level=1)  # version 0 may serve steps 0 and 1
    leases = [orchestrator.lease("w1", held=0) for _ in range(4)]  # 8 prompts: both batches it can serve
    assert [x["status"] for x in leases] == ["ok"] * 4
    answers: list[dict] = []
    waiting = threading.Thread(target=lambda: answers.append(orchestrator.lease("w2", held=0)))
    waiting.start()
    threading.Event().wait(0.1)
    assert not answers  # nothing wanted from version 0: it waits (poll_s 0.5)
    versions.announced = 1
    orchestrator._on_new_version(1)  # what the coordinator's announcement triggers
    waiting.join(5)
    assert answers[0]["status"] == "ok" and answers[0]["version"] == 1  # version 1 may serve step 2: work on it
    assert orchestrator.leases[answers[0]["lease"]].version == 1


def test_rollouts_being_verified_still_count_as_on_their_way(policy):
    """A worker sends its rollouts and at once asks for more (prime/rl/worker.py's Submitter): while the
    first are verified, their prompts must not be handed out again, or the extra rollouts go stale."""
    orchestrator, versions, _ = _orchestrator(policy, async_level=0)  # step 0 wants 4 prompts: 2 leases
    first, second = orchestrator.lease("w1", held=0), orchestrator.lease("w2", held=0)
    assert first["status"] == second["status"] == "ok"
    work = _work(orchestrator, versions, first)
    gate, verifying = threading.Event(), threading.Event()
    real = versions.verifier

    class HeldUp:
        def __init__(self, verifier):
            self.verifier, self.thresholds = verifier, verifier.thresholds

        def verify(self, claims):
            verifying.set()
            gate.wait(10)
            return self.verifier.verify(claims)

    versions.verifier = lambda version: HeldUp(real(version))
    answers = []
    sender = threading.Thread(target=lambda: answers.append(orchestrator.submit("w1", work)))
    sender.start()
    assert verifying.wait(10)
    assert orchestrator.lease("w1", held=0)["status"] == "wait"  # nothing wanted: 2 leased, 2 being verified
    gate.set()
    sender.join(10)
    assert answers == [{"status": "accepted", "rollouts": 8, "verify_s": answers[0]["verify_s"]}]
    assert orchestrator.lease("w1", held=0)["status"] == "wait"  # 2 ready, 2 leased: still nothing wanted
    assert not orchestrator.checking


def test_a_lease_given_back_returns_its_prompts_at_once(policy):
    """A worker that cannot get the version its lease names gives the lease back: its prompts go out
    again at once (not after lease_s), only the worker holding the lease may give it back, and the
    rollouts it might still send for it are refused."""
    orchestrator, versions, _ = _orchestrator(policy, async_level=0, lease_s=60)
    first, second = orchestrator.lease("w1", held=0), orchestrator.lease("w2", held=0)
    assert orchestrator.lease("w3", held=0)["status"] == "wait"  # step 0's 4 prompts are all leased
    assert orchestrator.give_back("w2", {"lease": first["lease"]})["status"] == "expired"  # not w2's lease
    assert orchestrator.give_back("w1", {"lease": first["lease"], "reason": "version 0 not fetched"}) == {"status": "ok"}
    again = orchestrator.lease("w3", held=0)
    assert again["status"] == "ok"
    assert [r["prompt"] for r in again["requests"]] == [r["prompt"] for r in first["requests"]]
    assert orchestrator.submit("w1", _work(orchestrator, versions, first))["status"] == "expired"
    assert orchestrator.give_back("w1", {"lease": first["lease"]})["status"] == "expired"  # once only
    assert orchestrator.counters.leases_expired == 0 and second["lease"] in orchestrator.leases


def test_a_worker_that_takes_leases_and_never_answers_holds_its_share_then_is_evicted(policy, caplog):
    """The attack of issue 50: one token takes every lease it can and answers none. It holds at most
    first_leases at once (the honest worker is served beside it), each expiry shrinks its share, and
    past max_unfinished it is evicted. A newline in a give-back reason does not forge a log line."""
    shares = {"first_leases": 3, "max_leases": 8, "max_unfinished": 4}
    orchestrator, versions, events = _orchestrator(policy, async_level=1, lease_s=1.0, poll_s=0.3,
                                                   prompts_per_step=64, shares=shares)
    taken_at = time.monotonic()
    taken = [orchestrator.lease("hog", held=0) for _ in range(3)]
    assert all(t["status"] == "ok" for t in taken)
    asked = time.monotonic()
    assert orchestrator.lease("hog", held=0)["status"] == "wait"  # its share is taken: held for poll_s
    assert time.monotonic() - asked >= 0.3
    honest = orchestrator.lease("honest", held=0)
    assert honest["status"] == "ok"
    assert orchestrator.submit("honest", _work(orchestrator, versions, honest))["status"] == "accepted"
    assert orchestrator.counters.of("honest").finished == 1
    time.sleep(max(0.0, taken_at + 1.05 - time.monotonic()))
    orchestrator.expire()  # its 3 leases expired: 3 unfinished against 0 finished, its share down to 1
    assert orchestrator.config.shares.allowed(orchestrator.counters.of("hog")) == 1
    with caplog.at_level("INFO"):
        one = orchestrator.lease("hog", held=0)
        assert orchestrator.lease("hog", held=0)["status"] == "wait"  # one at a time now
        assert orchestrator.give_back("hog", {"lease": one["lease"], "reason": "x\n12:00 [orchestrator] forged"}) \
            == {"status": "ok"}
    assert not any(line.startswith("12:00") for r in caplog.records for line in r.getMessage().splitlines()[1:])
    assert "x\\n12:00" in caplog.text
    last = orchestrator.lease("hog", held=0)  # 4 unfinished: at the limit, not past it
    assert last["status"] == "ok" and "hog" not in orchestrator.counters.evicted
    time.sleep(1.05)
    with pytest.raises(Refused, match="evicted: 5 leases expired or given back"):
        orchestrator.lease("hog", held=0)
    assert [e["worker"] for e in events if e["event"] == "evicted"] == ["hog"]
    again = orchestrator.lease("honest", held=0)  # the honest worker's share grew with what it finished
    assert again["status"] == "ok" and orchestrator.config.shares.allowed(orchestrator.counters.of("honest")) == 3


def test_garbage_on_a_lease_left_to_go_stale_is_punished_like_garbage_anywhere(policy):
    orchestrator, versions, _ = _orchestrator(policy, async_level=0)
    lease = orchestrator.lease("w", held=0)
    versions.add(1, copy.deepcopy(versions.model(0)))
    orchestrator.next_step = 1  # the lease is stale now: its rollouts can enter no batch
    with pytest.raises(Refused, match="evicted: .*failed verification"):
        orchestrator.submit("w", _work(orchestrator, versions, lease, tamper=answer_swap))
    honest = orchestrator.lease("h", held=1)
    versions.add(2, copy.deepcopy(versions.model(0)))
    orchestrator.next_step = 2
    assert orchestrator.submit("h", _work(orchestrator, versions, honest))["status"] == "stale"
    assert orchestrator.counters.of("h").finished == 1 and "h" not in orchestrator.counters.evicted
