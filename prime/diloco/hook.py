"""DiLoCo's outer loop: pseudo-gradients, the compressed all-reduce, the outer Nesterov step.

It attaches to the plain inner loop as a StepHook and runs every `inner_steps` steps. Each local rank
owns fp32 CPU copies of its FSDP2 shards (the outer params, prime/diloco/outer_optimizer.py); its global group
pairs it with the same shard on every other node. diloco.mode = blocking: the inner steps wait for the
outer step. delayed: the outer step of round k is decided in a background thread while round k+1
runs (prime/diloco/exchange.py) and applied one round late, keeping the local progress made meanwhile.
streaming: the same for one of F fragments every H/F steps, with up to F of them in flight.

The round is all-or-nothing: the pseudo-gradients stay intact until the coordinator says every
member's all-reduce succeeded ("apply"); on "abort" the same pseudo-gradients go into a retry with the
survivors. A node never applies its own pseudo-gradient alone.

A node that is behind (it joined a running job, missed a step's deadline, was partitioned away, or
diverged) catches up from its peers' transfer servers while the others go on (prime/diloco/catch_up.py) and
enters the next round with everyone. Faults enter only through the OuterStepFaults seam (faults.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

import torch

from elastic_mesh.control.client import CoordinatorError
from elastic_mesh.mesh import ElasticDeviceMesh, node_hash
from elastic_mesh.transfer.chunks import Deferred
from elastic_mesh.wire.codecs import codec_for
from prime.core.optim import adam_state_tensors
from prime.diloco.catch_up import CatchUp, whole_snapshot_step
from prime.diloco.config import DilocoConfig
from prime.diloco.exchange import (
    Exchange,
    InFlight,
    Pace,
    StepClock,
    exchange,
    plan_pace,
)
from prime.diloco.faults import NoFaults, OuterStepFaults
from prime.diloco.outer_optimizer import OuterOptimizer, local_shards
from prime.diloco.trainer_view import TrainerView

log = logging.getLogger(__name__)

# A node the coordinator drops again and again while it rejoins and catches up (each time a stall longer
# than the lease) gives up after this many in a row: something else is wrong with it or its link.
DROPS_IN_A_ROW = 5


class DilocoHook:
    """Runs the outer step every H inner steps; catches up from peers when the node is behind.
    `faults` is where a fault hook attaches (tests and the chaos harness); NoFaults otherwise."""

    def __init__(self, model: torch.nn.Module, mesh: ElasticDeviceMesh, config: DilocoConfig,
                 outer: OuterOptimizer, work_dir: Path, faults: OuterStepFaults | None = None) -> None:
        self.model, self.mesh, self.config, self.outer = model, mesh, config, outer
        self.work_dir = Path(work_dir)  # verified chunks of an interrupted download survive a restart here
        self.faults = faults or NoFaults()
        self.catch_up = CatchUp(model, mesh, config, outer, self.work_dir)
        self.codec = codec_for(config.compression)
        self.outer_step = 0  # the last committed outer step whose state this node holds
        self.tokens_contributed = 0  # tokens of this node's rounds that entered a committed average
        self._tokens_at_sync = 0
        self._publisher: threading.Thread | None = None
        self._inflight: deque[InFlight] = deque()  # overlapped modes: outer steps being decided, oldest first
        # delayed: the background thread's coordinator calls and agreements use their own local group
        self._background_mesh = mesh.background_view() if config.mode != "blocking" else None
        self._clock = StepClock()  # paces the overlapped modes' all-reduces (diloco.pace)
        self._overheads: deque[tuple[float, float]] = deque(maxlen=5)  # recent outer steps' (plan, vote + commit)

    def on_start(self, trainer: TrainerView) -> None:
        committed, restored = self.mesh.joined["committed_round"], self.outer_step
        if restored and self.config.mode != "blocking":
            self.outer.copy_to(local_shards(self.model))  # the checkpoint's local progress was never averaged
        if restored and restored == committed:  # resumed from a checkpoint of the run's newest step
            self._publish(restored, None, trainer.optimizer)  # others resumed may hold older checkpoints
            trainer.progress.note(f"resumed at outer step {restored} (the run's newest), hash "
                                  f"{node_hash(self.outer.digest())}")
        elif committed > 0:  # a running job: this node's weights are stale (initial, or an older checkpoint)
            trainer.metrics.write(self._rejoining(trainer, lambda: self._catch_up(trainer, full=not restored)))

    def _catch_up(self, trainer: TrainerView, full: bool) -> dict:
        """Reaches the run's newest committed step from peers (catch_up.py), nobody waiting for this node."""
        self._wait_for_publisher()
        self.catch_up.outer_step = self.outer_step
        try:
            record = self.catch_up.run(trainer, full)
        finally:  # also when it is cut short: the outer params hold the step it reached, and the next try starts there
            self.outer_step = self.catch_up.outer_step
            self.outer.forget_others()
        self._tokens_at_sync = trainer.tokens_seen
        return record

    def _rejoining(self, trainer: TrainerView, action: Callable[[], dict | None]) -> dict | None:
        """action() (a round, or a catch-up), joining again and catching up from peers whenever the
        coordinator turns out to have dropped this node meanwhile. A stall longer than the lease (swap, a
        preempted VM, SIGSTOP) gets a node declared dead at any moment, and it learns so from whichever
        request comes next: the exchange, or the commit of its hash right after, or a catch-up's sources,
        will-join or long-poll. Each rejoins; a node dropped again while catching up goes round again."""
        for attempt in range(1, DROPS_IN_A_ROW + 1):
            try:
                return action()
            except CoordinatorError as e:
                if not e.dropped or attempt == DROPS_IN_A_ROW:
                    raise
                log.warning("%s was dropped by the coordinator (%s); joining again and catching up from peers",
                            self.mesh.name, e)
                self._abandon_inflight()
                action = lambda: self._out_of_step(trainer, Exchange(self.outer_step, "dropped"))  # noqa: E731
        raise AssertionError("unreachable")

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Saved with every checkpoint: what a resumed node needs besides the model and inner optimizer."""
        self._wait_for_publisher()
        step = self.outer_step
        for inflight in self._inflight:  # applied to the outer params already; the model keeps its local progress
            if inflight.wait().status != "applied":
                break
            step = inflight.step
        return {"diloco_state": self.outer.state_tensor(), "diloco_outer_step": torch.tensor(step)}

    def on_end(self, trainer: TrainerView) -> None:
        """Keeps serving for a while after the last step, so a node still catching up can finish too."""
        applied = self.outer_step
        for inflight in self._inflight:  # a run that ends between outer steps: it ends on the last average
            if inflight.wait().status != "applied":
                break
            self.outer_step = inflight.step
        self._inflight.clear()
        if self.outer_step != applied:
            self.outer.copy_to(local_shards(self.model))
        if not self.config.serve_snapshots:
            return
        self._wait_for_publisher()
        deadline = time.monotonic() + self.config.linger_s
        try:
            while behind := self.mesh.rounds.sources()["behind"]:
                if time.monotonic() >= deadline:
                    log.warning("%s: %s still behind after %.0f s; leaving", self.mesh.name, ", ".join(behind),
                                self.config.linger_s)
                    return
                time.sleep(0.5)
        except CoordinatorError as e:
            if not e.dropped:
                raise
            log.warning("%s was dropped by the coordinator while it lingered to serve (%s); leaving", self.mesh.name, e)

    def after_step(self, trainer: TrainerView, step: int) -> dict | None:
        self._clock.tick()
        if self.config.mode != "blocking":
            return self._rejoining(trainer, lambda: self._overlapped_step(trainer, step))
        return None if step % self.config.inner_steps else self._rejoining(trainer, lambda: self._round(trainer))

    def _exchange(self, mesh: ElasticDeviceMesh, step: int, pseudo: torch.Tensor, data: list[dict],
                  contributes: bool = True, pace: Pace | None = None) -> Exchange:
        return exchange(mesh, step, pseudo, data, self.codec, self.config.outlier_factor,
                        lambda phase: self.faults.allreduce_phase(step, phase), contributes, pace)

    def _out_of_step(self, trainer: TrainerView, exchange: Exchange) -> dict:
        """The coordinator went on without this node (or dropped it): this round's work is thrown away and
        the node catches up from its peers, without anyone waiting for it."""
        if exchange.status == "dropped":
            self.mesh.rejoin()  # the background view sees the new session and heartbeat too
            self._settle_data(trainer, "forget")
            return self._catch_up(trainer, full=False)  # its own state may still be good: replay onto it
        self._settle_data(trainer, "rewind")
        return self._catch_up(trainer, full=exchange.status == "resync")

    def _commit(self, mesh: ElasticDeviceMesh, step: int) -> str:
        model_hash = mesh.node_hash(self.outer.digest())
        commit = mesh.rounds.commit(step, model_hash)
        if commit.get("status") == "diverged":
            log.error("%s: model hash %s differs from the run's %s at outer step %d; resyncing", mesh.name,
                      model_hash, commit.get("majority_hash"), step)
        return model_hash

    def _round_data(self, trainer: TrainerView, mark: bool = False) -> list[dict]:
        """What every worker of this node read this round; the coordinator records it with the step."""
        if trainer.leased is None:
            return [r for worker in self.mesh.gather([]) for r in worker]
        mine = trainer.leased.mark() if mark else trainer.leased.report()
        return [r for worker in self.mesh.gather(mine) for r in worker]

    def _round(self, trainer: TrainerView) -> dict:
        """blocking: the inner steps wait while the outer step is decided."""
        started = time.perf_counter()
        self._wait_for_publisher()
        shards = local_shards(self.model)
        step = self.outer_step + 1
        pseudo = self.outer.pseudo_gradient(shards)
        data = self._round_data(trainer)
        self.faults.pseudo_gradient(pseudo, step)
        exchange = self._exchange(self.mesh, step, pseudo, data)
        if exchange.status != "applied":
            return self._out_of_step(trainer, exchange)
        self.faults.decided(step)
        self.outer.step(exchange.result.mean, shards)
        if self.config.inner_optimizer == "reset":
            trainer.optimizer.state.clear()  # AdamW builds fresh moments (and step 0) at its next step
        self._settle_data(trainer, "committed" if exchange.contributed else "rewind")
        if exchange.contributed:
            self.tokens_contributed += trainer.tokens_seen - self._tokens_at_sync
        self._tokens_at_sync = trainer.tokens_seen
        self.outer_step = step
        if trainer.step != step * self.config.inner_steps:
            trainer.jump_to_step(step * self.config.inner_steps)
        model_hash = self._commit(self.mesh, step)
        self._publish(step, exchange.result, trainer.optimizer)
        return self._record(trainer, exchange, model_hash, time.perf_counter() - started)

    def _record(self, trainer: TrainerView, exchange: Exchange, model_hash: str, waited_s: float,
                fragment: int | None = 0, lag: int = 0) -> dict:
        """lag: inner steps between the launch of an overlapped outer step and its application."""
        plan, result = exchange.plan, exchange.result
        late = {"blocking": "", "delayed": " (applied one round late)" if lag == self.config.inner_steps
                else f" (applied {lag} steps late)",
                "streaming": " (all fragments: the run's last)" if fragment is None else
                             f" (fragment {fragment + 1}/{self.config.fragment_count}, applied "
                             f"{lag} steps late)"}[self.config.mode]
        record = {"outer_step": exchange.step, "epoch": plan.epoch, "members": len(result.contributors),
                  "nodes": plan.world_size, "attempt": plan.attempt, "allreduce_s": round(result.seconds, 4),
                  "outer_s": round(waited_s, 4), "exchange_s": round(exchange.seconds, 4),
                  "bytes_sent": result.bytes_sent, "bytes_received": result.bytes_received,
                  "model_hash": model_hash, "step": trainer.step, "tokens_contributed": self.tokens_contributed,
                  "refused": [plan.members[r]["name"] for r in result.refused], "fragment": fragment,
                  "kernel_paced": result.kernel_paced,
                  # Rounded as allreduce_s is, so that the transfer (which holds the all-reduce) never
                  # reads shorter than it.
                  "timings": {k: round(v, 4) for k, v in exchange.timings.items()}}
        trainer.progress.note(
            f"outer step {exchange.step}{late}: epoch {plan.epoch}, {len(result.contributors)}/{plan.world_size} "
            f"nodes averaged, all-reduce {result.seconds:.2f} s{' in the background' if late else ''}, "
            f"{result.bytes_sent / 1e6:.2f} MB sent, {'inner steps waited' if late else 'round'} {waited_s:.2f} s, "
            f"hash {model_hash}")
        return record

    # ---- delayed and streaming: outer steps decided in the background while the inner steps go on --------
    def _overlapped_step(self, trainer: TrainerView, step: int) -> dict | None:
        """Every inner step of the overlapped modes. An outer step launched τ steps ago (diloco.overlap) is
        applied now to its fragment of the model, keeping the local progress made since it was launched:
        θ ← outer + (θ − θ at launch). Every sync_period steps the next fragment's pseudo-gradient
        (outer − θ) is launched into the background. `delayed` is one fragment with τ = H (one-step-
        delayed DiLoCo); `streaming` is F fragments in turn, each overlapped for τ ≤ H steps (Streaming
        DiLoCo), so up to τ / (H/F) of them are in flight at once, each a different fragment."""
        started = time.perf_counter()
        outcome, record = self._apply_inflight(trainer, started, due_at=step)
        if outcome == "caught_up" or step % self.config.sync_period:
            return record
        return self._launch(trainer, step, record, contribute=outcome != "rewound", started=started)

    def _apply_inflight(self, trainer: TrainerView, started: float, due_at: int | None = None) -> tuple[str, dict | None]:
        """Applies the outer steps in flight that are due at inner step `due_at` (all of them: None), oldest
        first; with diloco.apply_early, also those already decided, however few steps ago they went out.
        Returns ("ok" | "rewound" | "caught_up", the last record; earlier ones are written).
        A step the peers refused (contributed nothing from this node) rewinds the reading since the last
        commit and drops the local progress; the steps after it went out without their reading, so they
        are waited for first and the rewind covers them too."""
        outcome, record = "ok", None
        while self._inflight and (due_at is None or due_at >= self._inflight[0].apply_at or self._decided_early()):
            inflight = self._inflight.popleft()
            exchange = inflight.wait()
            if exchange.status != "applied":
                self._abandon_inflight()  # the ones after it never started
                return "caught_up", self._out_of_step(trainer, exchange)  # reading since the last commit: read again
            if record:
                trainer.metrics.write(record)
            record = self._applied_late(trainer, exchange, inflight, time.perf_counter() - started)
            if outcome == "rewound":
                continue
            if exchange.contributed or inflight.rewound:
                self.outer.merge(local_shards(self.model), inflight.launched_from, inflight.fragment)
            else:
                outcome, due_at = "rewound", None
        if outcome == "rewound":
            self._settle_data(trainer, "rewind")
            self.outer.copy_to(local_shards(self.model))
        return outcome, record

    def _decided_early(self) -> bool:
        """diloco.apply_early: the oldest step in flight is decided on every local rank (they must apply
        at the same inner step: a failure sends them all into the same catch-up)."""
        return self.config.apply_early and self.mesh.agree(self._inflight[0].decided())

    def _apply_all_inflight(self, trainer: TrainerView, record: dict | None, started: float) -> tuple[str, dict | None]:
        """_apply_inflight for every step in flight, due or not; `record` (not yet written) goes first."""
        if record:
            trainer.metrics.write(record)
        return self._apply_inflight(trainer, started)

    def _abandon_inflight(self) -> None:
        for inflight in self._inflight:
            inflight.settled()  # a background thread must not touch the outer params while the node catches up
        self._inflight.clear()

    def _launch(self, trainer: TrainerView, step: int, record: dict | None, contribute: bool, started: float) -> dict | None:
        last = step >= trainer.config.train.max_steps
        if last and self._inflight:  # the run ends on the average of every step: the ones in flight first
            outcome, record = self._apply_all_inflight(trainer, record, started)
            if outcome == "caught_up":
                return record
            contribute = contribute and outcome != "rewound"
        outer_step = (self._inflight[-1].step if self._inflight else self.outer_step) + 1
        # Streaming's last outer step closes every fragment at once, so the run's product holds all the
        # work: each other fragment would lose the progress made since its own last turn (up to H − H/F
        # steps; cpu-demo, F=5: 10 of 150 steps on average, +4% eval loss against blocking).
        fragment = None if last and self.config.fragment_count > 1 else (outer_step - 1) % self.config.fragment_count
        shards = local_shards(self.model)
        pseudo = self.outer.pseudo_gradient(shards, fragment)
        self.faults.pseudo_gradient(pseudo, outer_step)
        finite = self.mesh.agree(bool(torch.isfinite(pseudo).all()))
        if contribute and not finite and self._inflight:
            # The reading is about to be rewound: the steps in flight commit theirs first (other fragments,
            # so this pseudo-gradient stands), or a refusal among them rewinds it already.
            outcome, record = self._apply_all_inflight(trainer, record, started)
            if outcome == "caught_up":
                return record
            contribute = outcome != "rewound"
        data = self._round_data(trainer, mark=True) if contribute else []  # the same on every local rank
        rewound = not contribute
        if not contribute:  # what it read was just rewound: nothing to contribute to this step
            pseudo = torch.zeros_like(pseudo)
        elif not finite:  # it goes out as it is, for the peers to refuse; the reading is read again
            self.outer.copy_to(shards)
            self._settle_data(trainer, "rewind")
            rewound = True
        elif self.config.eager != "off":
            self.outer.eager_step(shards, pseudo, fragment, mixed=self.config.eager == "mixed")
        tokens, self._tokens_at_sync = trainer.tokens_seen - self._tokens_at_sync, trainer.tokens_seen
        whole = whole_snapshot_step(outer_step, self.config.fragment_count) == outer_step  # served with a whole snapshot: copy the moments
        inner = adam_state_tensors(trainer.optimizer, list(self.model.parameters())) \
            if self.config.serve_snapshots and whole else None
        inflight = InFlight(outer_step, tokens, rewound, fragment, self.outer.snapshot(shards, fragment),
                            apply_at=step + self.config.overlap)
        if not last:
            pace = self._pace()
            after = self._inflight[-1] if self._inflight else None

            def decide(withhold: bool) -> Exchange:
                return self._background_exchange(
                    self._background_mesh, outer_step, torch.zeros_like(pseudo) if withhold else pseudo,
                    [] if withhold else data, contribute and not withhold, inner, fragment, pace)
            self._inflight.append(inflight.start(decide, after))
            return record
        # The last step: wait for this outer step and end on the outer model (the run's product, whose
        # hash the coordinator holds), dropping local progress no outer step averaged.
        if record:
            trainer.metrics.write(record)
        exchange = self._background_exchange(self.mesh, outer_step, pseudo, data, contribute, inner, fragment)
        if exchange.status != "applied":
            return self._out_of_step(trainer, exchange)
        self.outer.copy_to(shards)
        return self._applied_late(trainer, exchange, inflight, time.perf_counter() - started)

    def _pace(self) -> Pace | None:
        """diloco.pace: the outer step spread over that fraction of the inner steps between launches (or
        of τ, if shorter: it must be applied by then), so its mean rate is what the cadence needs; what
        is left of τ, less the time recent outer steps took to vote and commit after their transfer, is
        slack a late transfer uses before it speeds up (streaming with τ over H/F has the most)."""
        if not self.config.pace:
            return None
        share_s = self._clock.seconds(min(self.config.overlap, self.config.sync_period))
        window_s = self._clock.seconds(self.config.overlap)
        if share_s is None or window_s is None:
            return None
        return plan_pace(share_s, self.config.pace, window_s, list(self._overheads), time.monotonic())

    def _background_exchange(self, mesh: ElasticDeviceMesh, step: int, pseudo: torch.Tensor, data: list[dict],
                             contribute: bool, inner: dict | None, fragment: int,
                             pace: Pace | None = None) -> Exchange:
        """An overlapped outer step: decided, applied to the fragment's outer params (not the model),
        committed and served to peers, all while the inner steps go on."""
        exchange = self._exchange(mesh, step, pseudo, data, contribute, pace)
        decided = time.perf_counter()
        if exchange.status == "applied":
            self.faults.decided(step)
            self.outer.apply(exchange.result.mean, fragment)
            if self.config.eager == "mixed":  # the others' share of this step: the next estimate's
                self.outer.remember_others(fragment, exchange.result.mean, pseudo if exchange.contributed else None,
                                           len(exchange.result.contributors))
            exchange.model_hash = self._commit(mesh, step)
            if self.config.serve_snapshots:
                whole = whole_snapshot_step(step, self.config.fragment_count) == step
                if whole:
                    self._serve(step, inner, "inner")
                self._serve_state_and_update(step, self.outer.state_tensor() if whole else None, exchange.result,
                                             fragment)
            exchange.timings["settle_s"] = time.perf_counter() - decided
        return exchange

    def _applied_late(self, trainer: TrainerView, exchange: Exchange, inflight: InFlight, waited_s: float) -> dict:
        self.outer_step = exchange.step
        timings = exchange.timings
        self._overheads.append((timings.get("plan_s", 0.0), timings.get("vote_s", 0.0) + timings.get("settle_s", 0.0)))
        if exchange.contributed:
            self._settle_data(trainer, "committed")  # to the mark: the reading the outer step averaged
            self.tokens_contributed += inflight.tokens
        lag = trainer.step - (inflight.apply_at - self.config.overlap)
        record = self._record(trainer, exchange, exchange.model_hash, waited_s, inflight.fragment, lag)
        record["in_flight"] = len(self._inflight)  # launched after it and still being decided
        record["applied_after_steps"] = lag
        return record

    # ---- serving peers ---------------------------------------------------------------------------------
    def _serve(self, step: int, tensors: dict[str, torch.Tensor], kind: str, meta: dict | None = None) -> None:
        """Published deferred: laid out and hashed when a peer first asks (every tensor here is a copy
        made for serving, or the all-reduce's own bytes, which nothing writes again)."""
        self.mesh.server.publish(Deferred(step, tensors, meta, self.mesh.config.snapshot_chunk_bytes,
                                          self.faults.serving(kind, step)), kind)

    def _publish(self, step: int, result, optimizer) -> None:
        """Snapshot of step k and the update that made it, published in the background (the outer state does
        not change until the next outer step, which waits for this thread first). The update travels as
        the all-reduce's own encoded bytes: int8 is ~3.9× smaller than the fp32 mean, and decodes to it
        exactly. The inner AdamW moments are copied now (the next inner step changes them) and served
        too, so a joiner does not start from empty moments."""
        if not self.config.serve_snapshots:
            return
        state = self.outer.state_tensor()
        inner = adam_state_tensors(optimizer, list(self.model.parameters()))
        self._serve(step, inner, "inner")
        if result is None:  # resumed from a checkpoint: the state, without the update that made it
            self._serve(step, {"state": state}, "snapshot")
            return
        self._publisher = threading.Thread(target=self._serve_state_and_update, args=(step, state, result),
                                           daemon=True, name="snapshot-publisher")
        self._publisher.start()

    def _serve_state_and_update(self, step: int, state: torch.Tensor | None, result,
                                fragment: int | None = None) -> None:
        if result.wire is not None:
            update = {"wire": result.wire}
            meta = {"codec": self.codec.name, "layout": result.layout}
        else:  # nobody contributed: the mean is zeros, sent as is
            update, meta = {"mean": result.mean}, {}
        if fragment is not None and self.config.fragment_count > 1:
            meta["fragment"] = fragment
        if state is not None:
            self._serve(step, {"state": state}, "snapshot")
        self._serve(step, update, "update", meta)

    def _wait_for_publisher(self) -> None:
        if self._publisher is not None:
            self._publisher.join()
            self._publisher = None

    @staticmethod
    def _settle_data(trainer: TrainerView, outcome: str) -> None:
        """After a round: its reading was averaged (committed), must be read again (rewind: refused, missed),
        or the leases are gone with the node's old membership (forget)."""
        if trainer.leased is None:
            return
        if outcome == "committed":
            trainer.leased.committed()  # the running iterator goes on
        elif outcome == "rewind":
            trainer.leased.rewind()
            trainer.restart_data()
        else:
            trainer.leased.forget()
            trainer.restart_data()
