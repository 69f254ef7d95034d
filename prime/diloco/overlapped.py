"""diloco.mode = delayed or streaming: outer steps decided in background threads while the inner steps
go on (exchange.py's InFlight), each applied τ steps after its launch (diloco.overlap) to its fragment
of the model, keeping the local progress made meanwhile. `delayed` is one fragment with τ = H
(one-step-delayed DiLoCo); `streaming` is F fragments in turn, each overlapped for τ ≤ H steps
(Streaming DiLoCo), so up to τ / (H/F) of them are in flight at once, each a different fragment."""

from __future__ import annotations

import time
from collections import deque

import torch

from elastic_mesh import ElasticDeviceMesh
from prime.diloco.catch_up import whole_snapshot_step
from prime.diloco.exchange import Exchange, InFlight, Pace, StepClock, plan_pace
from prime.diloco.outer_optimizer import local_shards
from prime.diloco.replica import DilocoReplica
from prime.diloco.trainer_view import TrainerView


class OverlappedOuterLoop:
    """An OuterLoop (hook.py) whose outer steps run beside the inner steps."""

    def __init__(self, replica: DilocoReplica) -> None:
        self.replica, self.config = replica, replica.config
        self._inflight: deque[InFlight] = deque()  # outer steps being decided, oldest first
        # the background thread's coordinator calls and agreements use their own local group
        self._background_mesh = replica.mesh.background_view()
        self._clock = StepClock()  # paces the all-reduces (diloco.pace)
        self._overheads: deque[tuple[float, float]] = deque(maxlen=5)  # recent outer steps' (plan, vote + commit)

    # ---- the OuterLoop -----------------------------------------------------------------------------
    def on_start(self, trainer: TrainerView) -> None:
        if self.replica.outer_step:  # resumed: the checkpoint's local progress was never averaged
            self.replica.outer.copy_to(local_shards(self.replica.model))
        self.replica.start(trainer, abandon=self._abandon_inflight)

    def after_step(self, trainer: TrainerView, step: int) -> dict | None:
        self._clock.tick()
        return self.replica.rejoining(trainer, lambda: self._step(trainer, step), abandon=self._abandon_inflight)

    def on_end(self, trainer: TrainerView) -> None:
        ended_on = self.replica.outer_step
        for inflight in self._inflight:  # a run that ends between outer steps: it ends on the last average
            if inflight.wait().status != "applied":
                break
            ended_on = inflight.step
        self._inflight.clear()
        self.replica.finish(trainer, ended_on)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        self.replica.publisher.wait()
        step = self.replica.outer_step
        for inflight in self._inflight:  # applied to the outer params already; the model keeps its local progress
            if inflight.wait().status != "applied":
                break
            step = inflight.step
        return self.replica.outer_state(step)

    # ---- every inner step --------------------------------------------------------------------------
    def _step(self, trainer: TrainerView, step: int) -> dict | None:
        """An outer step launched τ steps ago is applied now to its fragment of the model, keeping the
        local progress made since it was launched: θ ← outer + (θ − θ at launch). Every sync_period steps
        the next fragment's pseudo-gradient (outer − θ) is launched into the background."""
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
        r = self.replica
        outcome, record = "ok", None
        while self._inflight and (due_at is None or due_at >= self._inflight[0].apply_at or self._decided_early()):
            inflight = self._inflight.popleft()
            exchange = inflight.wait()
            if exchange.status != "applied":
                self._abandon_inflight()  # the ones after it never started
                return "caught_up", r.out_of_step(trainer, exchange)  # reading since the last commit: read again
            if record:
                trainer.metrics.write(record)
            record = self._applied_late(trainer, exchange, inflight, time.perf_counter() - started)
            if outcome == "rewound":
                continue
            if exchange.contributed or inflight.rewound:
                r.outer.merge(local_shards(r.model), inflight.launched_from, inflight.fragment)
            else:
                outcome, due_at = "rewound", None
        if outcome == "rewound":
            r.settle_data(trainer, "rewind")
            r.outer.copy_to(local_shards(r.model))
        return outcome, record

    def _decided_early(self) -> bool:
        """diloco.apply_early: the oldest step in flight is decided on every local rank (they must apply
        at the same inner step: a failure sends them all into the same catch-up)."""
        return self.config.apply_early and self.replica.mesh.agree(self._inflight[0].decided())

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
        r = self.replica
        last = step >= trainer.config.train.max_steps
        if last and self._inflight:  # the run ends on the average of every step: the ones in flight first
            outcome, record = self._apply_all_inflight(trainer, record, started)
            if outcome == "caught_up":
                return record
            contribute = contribute and outcome != "rewound"
        outer_step = (self._inflight[-1].step if self._inflight else r.outer_step) + 1
        # Streaming's last outer step closes every fragment at once, so the run's product holds all the
        # work: each other fragment would lose the progress made since its own last turn (up to H − H/F
        # steps; cpu-demo, F=5: 10 of 150 steps on average, +4% eval loss against blocking).
        fragment = None if last and self.config.fragment_count > 1 else (outer_step - 1) % self.config.fragment_count
        shards = local_shards(r.model)
        pseudo = r.outer.pseudo_gradient(shards, fragment)
        r.faults.pseudo_gradient(pseudo, outer_step)
        finite = r.mesh.agree(bool(torch.isfinite(pseudo).all()))
        if contribute and not finite and self._inflight:
            # The reading is about to be rewound: the steps in flight commit theirs first (other fragments,
            # so this pseudo-gradient stands), or a refusal among them rewinds it already.
            outcome, record = self._apply_all_inflight(trainer, record, started)
            if outcome == "caught_up":
                return record
            contribute = outcome != "rewound"
        data = r.round_data(trainer, mark=True) if contribute else []  # the same on every local rank
        rewound = not contribute
        if not contribute:  # what it read was just rewound: nothing to contribute to this step
            pseudo = torch.zeros_like(pseudo)
        elif not finite:  # it goes out as it is, for the peers to refuse; the reading is read again
            r.outer.copy_to(shards)
            r.settle_data(trainer, "rewind")
            rewound = True
        elif self.config.eager != "off":
            r.outer.eager_step(shards, pseudo, fragment, mixed=self.config.eager == "mixed")
        tokens, r.tokens_at_sync = trainer.tokens_seen - r.tokens_at_sync, trainer.tokens_seen
        whole = whole_snapshot_step(outer_step, self.config.fragment_count) == outer_step  # served with a whole snapshot: copy the moments
        inner = r.publisher.inner_moments(trainer.optimizer) if self.config.serve_snapshots and whole else None
        inflight = InFlight(outer_step, tokens, rewound, fragment, r.outer.snapshot(shards, fragment),
                            apply_at=step + self.config.overlap)
        if not last:
            pace = self._pace()

            def decide(withhold: bool) -> Exchange:
                return self._background_exchange(
                    self._background_mesh, outer_step, torch.zeros_like(pseudo) if withhold else pseudo,
                    [] if withhold else data, contribute and not withhold, inner, fragment, pace)
            self._inflight.append(inflight.start(decide, self._inflight[-1] if self._inflight else None))
            return record
        # The last step: wait for this outer step and end on the outer model (the run's product, whose
        # hash the coordinator holds), dropping local progress no outer step averaged.
        if record:
            trainer.metrics.write(record)
        exchange = self._background_exchange(r.mesh, outer_step, pseudo, data, contribute, inner, fragment)
        if exchange.status != "applied":
            return r.out_of_step(trainer, exchange)
        r.outer.copy_to(shards)
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
        r = self.replica
        exchange = r.exchange(mesh, step, pseudo, data, contribute, pace, fragment)
        decided = time.perf_counter()
        if exchange.status == "applied":
            r.faults.decided(step)
            r.outer.apply(exchange.result.mean, fragment)
            if self.config.eager == "mixed":  # the others' share of this step: the next estimate's
                sent = exchange.result.sent if exchange.result.sent is not None else pseudo  # sparse: as decoded
                r.outer.remember_others(fragment, exchange.result.mean, sent if exchange.contributed else None,
                                        len(exchange.result.contributors))
            exchange.model_hash = r.commit(mesh, step)
            if self.config.serve_snapshots:
                whole = whole_snapshot_step(step, self.config.fragment_count) == step
                if whole:
                    r.publisher.serve(step, inner, "inner")
                r.publisher.serve_state_and_update(step, r.outer.state_tensor() if whole else None,
                                                   exchange.result, fragment)
            exchange.timings["settle_s"] = time.perf_counter() - decided
        return exchange

    def _applied_late(self, trainer: TrainerView, exchange: Exchange, inflight: InFlight, waited_s: float) -> dict:
        r = self.replica
        r.outer_step = exchange.step
        timings = exchange.timings
        self._overheads.append((timings.get("plan_s", 0.0), timings.get("vote_s", 0.0) + timings.get("settle_s", 0.0)))
        if exchange.contributed:
            r.settle_data(trainer, "committed")  # to the mark: the reading the outer step averaged
            r.tokens_contributed += inflight.tokens
        lag = trainer.step - (inflight.apply_at - self.config.overlap)
        record = r.record(trainer, exchange, exchange.model_hash, waited_s, inflight.fragment, lag)
        record["in_flight"] = len(self._inflight)  # launched after it and still being decided
        record["applied_after_steps"] = lag
        return record
