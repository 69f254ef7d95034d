"""The orchestrator (trusted): prompts out as leases, rollouts in, verified, scored, batched.

- **Leases.** A worker asks for work stating the policy version it holds. It gets `prompts_per_lease`
  prompts, each with G seeds that the orchestrator drew (so a worker cannot pick its samples), and the
  sampling settings. A lease not returned within `lease_s`, or held by a worker that is evicted, goes
  back to the front of the queue; its late rollouts are refused. Every prompt instance has a number and
  enters at most one batch.
- **Async level k.** Rollouts of version v may serve the batches of steps v .. v + k. A worker holding a
  version older than newest - k is told to fetch the newest; leases are handed out only while the
  batches those rollouts can still serve need prompts, so workers run at most k versions ahead of the
  trainer and little work goes stale. At k = 0 generation and training alternate.
- **Verification.** Every rollout is checked by TOPLOC against the claimed version before it is scored.
  One failed rollout rejects the worker's whole submission, evicts the worker's token (its other leases
  go back, its unbatched groups are dropped) and every later request of that token is refused.
- **Rewards and advantages** are computed here with the task's own verifier; a worker's word about its
  rollout's quality is never asked for.
- **Restarts.** `state()` is what a restarted orchestrator needs, saved by the `RunStore` whenever a batch
  is built, a worker is evicted or the run ends: the next step and the newest batches (each written once,
  to a file of its own), as many as the
  trainer said it may ask again after a restart (it checkpoints every few steps), how far the task
  stream was read, the counters (evictions stay in force) and which start this is. `restore()` takes it
  back. Prompts leased or scored but not yet in a batch at the stop are skipped, never used twice;
  lease ids carry the start, so a lease from before can never match one from after.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from dataclasses import asdict

import torch

from elastic_mesh import Refused, printable
from prime.inference.sampling import SamplingParams
from prime.rl.environments.base import Environment
from prime.rl.grpo import GRPOConfig, group_advantages
from prime.rl.orchestrator.config import OrchestratorConfig
from prime.rl.orchestrator.prompts import PromptQueue
from prime.rl.orchestrator.records import Counters, Group, Lease, WorkerStats, batch_timing
from prime.rl.orchestrator.run_store import RunStore
from prime.rl.orchestrator.submission import MALFORMED, completion_from_wire
from prime.rl.orchestrator.versions import VerifiedVersions
from prime.verify.verifier import Claim

log = logging.getLogger(__name__)

# The most batches a trainer may ask to be kept for its restart (each a step's rows, in a file of its own:
# run_store.py).
MAX_BATCHES_KEPT = 64


class Orchestrator:
    def __init__(self, config: OrchestratorConfig, env: Environment, versions: VerifiedVersions,
                 record=lambda event: None, store: RunStore | None = None) -> None:
        self.config, self.env, self.versions, self.record = config, env, versions, record
        self.store = store or RunStore(None)
        self.sampling = SamplingParams(temperature=config.temperature, top_p=config.top_p, max_tokens=config.max_tokens)
        self.grpo = GRPOConfig(group_size=config.group_size, std_epsilon=config.std_epsilon)
        self.prompts = PromptQueue(env.tasks("train", config.seed), versions.tokenize, self._context, config.max_tokens)
        self._batched = 0  # prompts that entered a batch (filtered groups included)
        self.start = 0  # how many times this run's orchestrator started before this one
        self._seeds = random.Random(f"{config.seed}-seeds")
        self.leases: dict[str, Lease] = {}
        self.checking: dict[str, Lease] = {}  # submitted, being verified: still counted as on their way
        self.ready: list[Group] = []
        self.batches: dict[int, dict] = {}
        # How many of the newest batches are kept: a trainer that checkpoints every n steps may come back
        # from a restart up to n steps behind the newest batch it asked for, so it asks for n + 1 (batch()).
        self.batches_kept = 2
        self.next_step = 0
        self.done = False
        self.final_version = -1  # the trainer's last version, once it finished
        self.last_batch_event: dict | None = None
        self.counters = Counters()
        self.used_numbers: set[int] = set()  # prompt instances already in a batch
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.started = time.monotonic()
        self._asked = (-1, 0.0)  # (step, when the trainer first asked for its batch), for batch stats
        versions.on_new = versions.on_announced = self._on_new_version

    # ---- versions ------------------------------------------------------------------------------------
    def _on_new_version(self, version: int) -> None:
        with self.changed:
            self.changed.notify_all()

    @property
    def oldest_usable(self) -> int:
        """The oldest version whose rollouts can still enter a batch."""
        return self.next_step - self.config.async_level

    def _context(self) -> int | None:
        """The policy's context length, once a version is held (prompts are drawn only then)."""
        return getattr(self.versions.model(self.versions.newest).config, "max_position_embeddings", None)

    # ---- leases --------------------------------------------------------------------------------------
    def lease(self, worker: str, held: int, dtype: str = "float32") -> dict:
        """dtype: the worker's compute dtype, as its token admits it (prime/rl/token_flags.py)."""
        allowed = self.versions.allowed_dtypes()
        if allowed is not None and dtype not in allowed:
            raise Refused(403, f"worker token {worker} admits a {printable(dtype)} worker, but this run's policy was "
                               f"calibrated for {', '.join(allowed)} workers only; ask the operator for a token made "
                               f"with --attributes dtype={allowed[0]} (and run the worker with --dtype {allowed[0]})")
        give_up = time.monotonic() + self.config.poll_s
        with self.changed:
            self.counters.of(worker).last_seen_s = self.elapsed()
            while True:
                self.expire()
                self._refuse_evicted(worker)
                if self.done:
                    return {"status": "done"}
                # Announced, not loaded: a worker that got a version first need not wait for this side's
                # own download to be given work; only the verification of its rollouts waits for it.
                newest = self.versions.announced
                # A worker already at the newest version this side heard of waits here for the next one
                # (next_step can run ahead of the announcements this side has heard): told to fetch what it
                # holds, it would ask again at once, hundreds of times a second.
                if newest >= 0 and (held < 0 or held < max(newest - self.config.async_level, self.oldest_usable)) \
                        and held < newest:
                    return {"status": "fetch", "version": newest}
                # Prompts are tokenized with the tokenizer of the first version loaded here; held > newest:
                # a version not announced here yet.
                room = self._room(worker)
                if room and self.versions.tokenizer is not None and 0 <= held <= newest and self._wanted(held) > 0:
                    return self._grant(worker, held)
                # Nothing wanted from the version it names, but work for the newest: most likely its follower
                # is loading that one, and waiting here for the next batch to free work for the older one
                # would keep its rollouts two versions old and the pipeline one batch short. The lease is
                # on the newest: the worker starts on it the moment it holds it, one round trip sooner.
                if room and self.versions.tokenizer is not None and 0 <= held < newest and self._wanted(newest) > 0:
                    return self._grant(worker, newest)
                remaining = give_up - time.monotonic()
                if remaining <= 0:
                    return {"status": "wait"}
                self.changed.wait(min(remaining, 1.0))

    def _room(self, worker: str) -> bool:
        """Whether `worker` may take one more lease now: its leases out and being verified are under
        its share (shares.py)."""
        holding = sum(1 for lease in (*self.leases.values(), *self.checking.values()) if lease.worker == worker)
        return holding < self.config.shares.allowed(self.counters.of(worker))

    def _wanted(self, version: int) -> int:
        """Prompts still wanted from rollouts of `version`: what the batches it may serve lack, less the
        groups ready or in flight for them."""
        last_step = version + self.config.async_level
        if last_step < self.next_step:
            return 0
        need = (last_step - self.next_step + 1) * self.config.prompts_per_step
        have = sum(1 for g in self.ready if g.version + self.config.async_level >= self.next_step)
        have += sum(len(lease.prompts) for lease in (*self.leases.values(), *self.checking.values()))
        return need - have

    def _grant(self, worker: str, version: int) -> dict:
        count = min(self.config.prompts_per_lease, self._wanted(version))
        prompts = [self.prompts.next() for _ in range(count)]
        seeds = [[self._seeds.getrandbits(63) for _ in range(self.config.group_size)] for _ in prompts]
        now = time.monotonic()
        lease = Lease(f"{worker}-{self.start}-{next(self.prompts.numbers)}", worker, version, prompts, seeds,
                      now + self.config.lease_s, granted_at=now)
        self.leases[lease.lease_id] = lease
        self.counters.of(worker).leases += 1
        return {"status": "ok", "lease": lease.lease_id, "version": version, "lease_s": self.config.lease_s,
                "sampling": self.sampling.model_dump(),
                "requests": [{"prompt": p.tokens, "seed": s} for p, group in zip(prompts, seeds) for s in group]}

    def _release(self, lease: Lease, why: str) -> None:
        self.leases.pop(lease.lease_id, None)
        self.prompts.give_back(lease.prompts)
        log.info("lease %s of worker %s returned (%s): %d prompts back in the queue", lease.lease_id, lease.worker,
                 why, len(lease.prompts))
        self.changed.notify_all()

    def expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            # Latest first: each goes to the front of the queue, so the oldest prompts are handed out first.
            late = sorted((x for x in self.leases.values() if x.deadline < now), key=lambda x: -x.deadline)
            for lease in late:
                self.counters.leases_expired += 1
                self.counters.of(lease.worker).expired += 1
                self._release(lease, f"not returned within {self.config.lease_s:.0f} s")
            for worker in {lease.worker for lease in late}:
                self._judge_unfinished(worker)

    def _judge_unfinished(self, worker: str) -> None:
        """Evicts `worker` when the leases it let expire or gave back are past its share."""
        why = self.config.shares.evicts(self.counters.of(worker))
        if why is not None and worker not in self.counters.evicted:
            self._evict_worker(worker, 0, why)

    def give_back(self, worker: str, body: dict) -> dict:
        """A worker hands a lease back unworked (it could not get the version the lease names): its
        prompts go to the front of the queue now rather than when the lease expires, which would keep the
        batch they were promised to waiting that long."""
        with self.changed:
            self.counters.of(worker).last_seen_s = self.elapsed()
            self._refuse_evicted(worker)
            lease = self.leases.get(str(body.get("lease", "")))
            if lease is None or lease.worker != worker:
                return {"status": "expired", "detail": "no such lease of this worker (returned after its deadline?)"}
            self.counters.of(worker).given_back += 1
            self._release(lease, f"given back by its worker: {printable(body.get('reason', ''), 120)}")
            self._judge_unfinished(worker)
            return {"status": "ok"}

    def _refuse_evicted(self, worker: str) -> None:
        if worker in self.counters.evicted:
            raise Refused(403, f"worker token {worker} was evicted: {self.counters.evicted[worker]}")

    # ---- rollouts ------------------------------------------------------------------------------------
    def submit(self, worker: str, body: dict, dtype: str = "float32") -> dict:
        """dtype: the worker's compute dtype, as its token admits it: its rollouts must claim it."""
        arrived = time.monotonic()
        with self.lock:
            self.counters.of(worker).last_seen_s = self.elapsed()
            self.expire()
            self._refuse_evicted(worker)
            lease = self.leases.get(str(body.get("lease", "")))
            if lease is None or lease.worker != worker:
                return {"status": "expired", "detail": "no such lease of this worker (returned after its deadline?)"}
            del self.leases[lease.lease_id]
            # Counted as on its way until verified: a worker that sends its rollouts and leases again at
            # once (prime/rl/worker.py) must not be handed the prompts these rollouts are about to fill.
            self.checking[lease.lease_id] = lease
        try:
            return self._check(worker, lease, body, arrived, dtype)
        finally:
            with self.changed:
                self.checking.pop(lease.lease_id, None)
                self.changed.notify_all()

    def _check(self, worker: str, lease: Lease, body: dict, arrived: float, dtype: str) -> dict:
        """Verifies a submission and keeps its groups, or drops it as stale, or evicts its worker."""
        expected = len(lease.prompts) * self.config.group_size
        try:
            completions = [completion_from_wire(entry) for entry in body["completions"]]
            if len(completions) != expected:
                raise ValueError(f"{len(completions)} completions for a lease of {expected} requests")
            claimed = sorted({c.compute_dtype for c in completions} - {dtype})
            if claimed:  # a float32 worker claiming bfloat16 would be held to bfloat16's looser limits
                raise ValueError(f"rollouts claim compute dtype {printable(claimed[0])}, but this worker's token "
                                 f"admits it as a {dtype} worker")
        except MALFORMED as e:
            return self._evict(lease, expected, f"malformed submission: {e}")
        try:
            verifier = self.versions.verifier(lease.version)
        except KeyError:  # too old to be held here any more: dropped unverified, and counted against it
            with self.lock:
                self.counters.of(worker).expired += 1
                self._judge_unfinished(worker)
            return self._stale(lease, expected)
        seeds = [s for group in lease.seeds for s in group]
        prompts = [p for p in lease.prompts for _ in range(self.config.group_size)]
        claims = [Claim(p.tokens, seed, self.sampling, c) for p, seed, c in zip(prompts, seeds, completions)]
        started = time.perf_counter()
        verdicts = verifier.verify(claims)
        verify_s = time.perf_counter() - started
        rejected = [(i, v) for i, v in enumerate(verdicts) if not v.accepted]
        bound = getattr(verifier.thresholds.limits.get(dtype), "deviation_rate", None)  # none if not calibrated
        with self.lock:
            self.counters.of(worker).verify_s += verify_s
            score, drifted = self.config.evidence.judge(self.counters.of(worker), verdicts, bound, dtype)
        if drifted:
            return self._evict(lease, expected, drifted)
        if rejected:  # a stale lease's rollouts too: garbage is punished wherever it is sent
            i, verdict = rejected[0]
            why = f"{len(rejected)} of {expected} rollouts failed verification, e.g. #{i}: {verdict.reason}"
            if self.config.evidence.evicts(score):
                return self._evict(lease, expected, f"{why} (evidence {score:.1f}, evicted at "
                                                    f"{self.config.evidence.evict_at:g})")
            return self._drop(lease, expected, why, self.counters.of(worker).evidence)
        if lease.version < self.oldest_usable:
            with self.lock:
                self.counters.of(worker).finished += 1
            return self._stale(lease, expected)
        groups = []
        for index, prompt in enumerate(lease.prompts):
            chosen = completions[index * self.config.group_size:(index + 1) * self.config.group_size]
            rewards = [self.env.reward(prompt.task, self.versions.decode(c.tokens)) for c in chosen]
            groups.append(Group(prompt, lease.version, worker, chosen, rewards, lease.granted_at, arrived,
                                time.monotonic()))
        with self.changed:
            if worker in self.counters.evicted:
                return {"status": "evicted"}
            if lease.version < self.oldest_usable:
                return self._stale(lease, expected)
            self.ready.extend(groups)
            self.counters.rollouts_accepted += expected
            self.counters.of(worker).verified += expected
            self.counters.of(worker).finished += 1
            self.changed.notify_all()
        return {"status": "accepted", "rollouts": expected, "verify_s": round(verify_s, 4)}

    def _stale(self, lease: Lease, rollouts: int) -> dict:
        with self.changed:
            self.counters.rollouts_stale += rollouts
            self.counters.of(lease.worker).stale += rollouts
            self.prompts.give_back(lease.prompts)
            self.changed.notify_all()
        newest = self.versions.newest
        log.info("lease %s of version %d came back stale (batches now need >= %d): %d rollouts dropped, prompts "
                 "requeued; worker %s told to fetch %d", lease.lease_id, lease.version, self.oldest_usable, rollouts,
                 lease.worker, newest)
        return {"status": "stale", "version": newest}

    def _drop(self, lease: Lease, rollouts: int, why: str, score: float) -> dict:
        """Failed rollouts, their worker kept: all the lease's are refused (a group needs every sample)."""
        with self.changed:
            self.counters.rollouts_rejected += rollouts
            self.counters.of(lease.worker).rejected += rollouts
            self.prompts.give_back(lease.prompts)
            self.changed.notify_all()
        log.warning("lease %s of worker %s dropped: %s (evidence %.1f of %g)", lease.lease_id, lease.worker,
                    printable(why[:300]), score, self.config.evidence.evict_at)
        return {"status": "rejected", "detail": why[:500], "evidence": round(score, 2)}

    def _evict(self, lease: Lease, rollouts: int, why: str) -> dict:
        """Evicts the worker of `lease` (its rollouts refused) and refuses the request that brought them."""
        with self.changed:
            self.prompts.give_back(lease.prompts)
            self._evict_worker(lease.worker, rollouts, why)
        raise Refused(403, f"evicted: {why}")

    def _evict_worker(self, worker: str, rollouts: int, why: str) -> None:
        """Ends `worker`'s part in the run: its leases go back to the queue, its unbatched groups are
        dropped, every later request of its token is refused."""
        with self.changed:
            self.counters.rollouts_rejected += rollouts
            if worker in self.counters.evicted:  # a second submission verified beside the one that evicted it
                self.counters.of(worker).rejected += rollouts
                return
            self.counters.evicted[worker] = why
            self.counters.workers_evicted += 1
            for other in [x for x in self.leases.values() if x.worker == worker]:
                self._release(other, "its worker was evicted")
            dropped = [g for g in self.ready if g.worker == worker]
            self.ready = [g for g in self.ready if g.worker != worker]
            self.counters.rollouts_rejected += sum(len(g.completions) for g in dropped)
            self.counters.of(worker).rejected += rollouts + sum(len(g.completions) for g in dropped)
            self.changed.notify_all()
            log.warning("worker %s evicted: %s (%d rollouts rejected, %d of its unbatched groups dropped)",
                        worker, why, rollouts, len(dropped))
            self.record({"event": "evicted", "worker": worker, "reason": why[:300], "time_s": self.elapsed()})
            self.store.save(self.state())

    # ---- batches -------------------------------------------------------------------------------------
    def batch(self, step: int, keep: int = 2) -> dict:
        """The batch of trainer step `step` (long-poll). A step already built is answered again, so a
        trainer restarted from its checkpoint trains on exactly what it would have. keep: how many of the
        newest batches the trainer may ask again after a restart (its checkpoint interval + 1); never
        fewer than the trainer asked for before (a restarted one may say less)."""
        if not 2 <= keep <= MAX_BATCHES_KEPT:
            raise Refused(400, f"keep must be between 2 and {MAX_BATCHES_KEPT} batches, not {keep}")
        give_up = time.monotonic() + self.config.poll_s
        with self.changed:
            self.batches_kept = max(self.batches_kept, keep)
            if self._asked[0] != step:
                self._asked = (step, time.monotonic())
            while True:
                if step in self.batches:
                    return self.batches[step]
                if self.done:
                    return {"status": "done"}
                if step != self.next_step:
                    raise Refused(409, f"batch {step} asked for; the next batch is {self.next_step} (only the last "
                                       f"{len(self.batches)} built are kept: did the trainer resume from a "
                                       f"checkpoint older than its checkpoint_every?)")
                self._drop_stale(step)
                if len(self.ready) >= self.config.prompts_per_step:
                    return self._build(step, self._asked[1])
                remaining = give_up - time.monotonic()
                if remaining <= 0:
                    return {"status": "wait", "ready": len(self.ready)}
                self.changed.wait(min(remaining, 1.0))

    def _drop_stale(self, step: int) -> None:
        oldest = step - self.config.async_level
        stale = [g for g in self.ready if g.version < oldest]
        if stale:
            self.ready = [g for g in self.ready if g.version >= oldest]
            self.counters.rollouts_stale += sum(len(g.completions) for g in stale)
            for g in stale:
                self.counters.of(g.worker).stale += len(g.completions)
            log.info("batch %d: %d groups of versions < %d dropped as stale", step, len(stale), oldest)

    def _build(self, step: int, asked_at: float) -> dict:
        self.ready.sort(key=lambda g: (g.version, g.prompt.number))  # oldest first: the first to go stale
        taken, self.ready = self.ready[:self.config.prompts_per_step], self.ready[self.config.prompts_per_step:]
        self._batched += len(taken)
        rewards = torch.tensor([g.rewards for g in taken])
        advantages, varied = group_advantages(rewards, self.grpo)
        keep = self._keep(rewards, varied)
        rows = []
        for g, adv, k in zip(taken, advantages, keep):
            assert g.prompt.number not in self.used_numbers, f"prompt {g.prompt.number} would enter a second batch"
            self.used_numbers.add(g.prompt.number)
            if k:
                rows += [{"prompt": g.prompt.tokens, "tokens": c.tokens, "logprobs": c.logprobs,
                          "advantage": float(a), "version": g.version} for c, a in zip(g.completions, adv)]
        self.counters.groups_filtered += int((~keep).sum())
        staleness = [step - g.version for g in taken]
        stats = {"reward_mean": float(rewards.mean()), "groups": len(taken), "groups_kept": int(keep.sum()),
                 "staleness_mean": sum(staleness) / len(staleness), "staleness_max": max(staleness),
                 "prompt_numbers": [g.prompt.number for g in taken], **batch_timing(taken, asked_at)}
        batch = {"status": "ok", "step": step, "temperature": self.config.temperature, "rows": rows, "stats": stats}
        self.batches[step] = batch
        for old in [s for s in self.batches if s <= step - self.batches_kept]:
            del self.batches[old]
        self.next_step = step + 1
        workers: dict[str, int] = {}
        for g in taken:
            workers[g.worker] = workers.get(g.worker, 0) + len(g.completions)
        # Saved with the batch: a stop between the two writes leaves a batch the run uses whose record
        # a restart writes (record_unrecorded_batch), never a record of a batch it does not use.
        self.last_batch_event = {"event": "batch", "step": step, "time_s": self.elapsed(), **stats,
                                 "workers": workers, **self.totals()}
        self.store.save_batch(step, batch)  # written once; the state saved next names it
        self.store.save(self.state())  # before the trainer can see the batch: a restart serves it again
        self.changed.notify_all()
        self.record(self.last_batch_event)
        return batch

    def record_unrecorded_batch(self, recorded_steps: set[int]) -> None:
        """After a restart: records the newest batch's event if the stop came before it was written."""
        event = self.last_batch_event
        if event is not None and event["step"] not in recorded_steps:
            log.info("batch %d's record was not written before the stop; written now", event["step"])
            self.record(event)

    def _keep(self, rewards: torch.Tensor, varied: torch.Tensor) -> torch.Tensor:
        f = self.config.filter
        keep = varied.clone() if f.drop_flat else torch.ones_like(varied)
        solved = (rewards >= f.solved_at).float().mean(dim=1)
        if f.drop_all_solved:
            keep &= solved < 1
        if f.drop_none_solved:
            keep &= solved > 0
        return keep

    def finish(self, version: int) -> dict:
        with self.changed:
            self.final_version = max(self.final_version, version)
            self.done = True
            self.store.save(self.state())
            self.changed.notify_all()
        log.info("the trainer finished at version %d", version)
        return {"status": "ok"}

    # ---- restarts ------------------------------------------------------------------------------------
    def state(self) -> dict:
        """What a restarted orchestrator needs (JSON); call with the lock held."""
        c = self.counters
        return {"start": self.start, "next_step": self.next_step, "batch_steps": sorted(self.batches),
                "batches_kept": self.batches_kept, "drawn": self.prompts.drawn,
                "batched": self._batched, "next_number": next(self.prompts.numbers), "elapsed_s": self.elapsed(),
                "done": self.done,
                "final_version": self.final_version, "last_batch_event": self.last_batch_event,
                "counters": {**self.totals(), "evicted": dict(c.evicted),
                             "workers": {w: asdict(s) for w, s in c.workers.items()}}}

    def restore(self, state: dict) -> int:
        """Continues from `state()` of an earlier start; returns the prompts it skips (in flight at the stop)."""
        with self.lock:
            self.start = int(state["start"]) + 1
            self.next_step = int(state["next_step"])
            self.batches = {int(step): batch for step, batch in state["batches"].items()}
            self.batches_kept = int(state.get("batches_kept", 2))
            self.used_numbers = {n for b in self.batches.values() for n in b["stats"]["prompt_numbers"]}
            self._batched = int(state["batched"])
            self.prompts.resume(int(state["drawn"]), int(state["next_number"]))  # the stream is deterministic
            self._seeds = random.Random(f"{self.config.seed}-seeds-{self.start}")  # no seed handed out twice
            self.started = time.monotonic() - float(state["elapsed_s"])
            self.done, self.final_version = bool(state["done"]), int(state["final_version"])
            self.last_batch_event = state.get("last_batch_event")
            saved = state["counters"]
            self.prompts.refused = int(saved.get("prompts_refused", 0))
            self.counters = Counters(**{k: saved[k] for k in self.totals() if k != "prompts_refused"},
                                     evicted=dict(saved["evicted"]),
                                     workers={w: WorkerStats(**s) for w, s in saved["workers"].items()})
            return self.prompts.drawn - self._batched

    def totals(self) -> dict:
        c = self.counters
        return {"rollouts_accepted": c.rollouts_accepted, "rollouts_rejected": c.rollouts_rejected,
                "rollouts_stale": c.rollouts_stale, "groups_filtered": c.groups_filtered,
                "leases_expired": c.leases_expired, "workers_evicted": c.workers_evicted,
                "prompts_refused": self.prompts.refused}

    def leases_by_worker(self) -> dict[str, int]:
        with self.lock:
            return dict(collections.Counter(lease.worker for lease in self.leases.values()))

    def elapsed(self) -> float:
        return round(time.monotonic() - self.started, 3)

