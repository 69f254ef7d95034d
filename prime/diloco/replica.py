"""A node as one DiLoCo replica: the state both outer-loop modes keep (the outer optimizer, the last
committed outer step, the tokens contributed) and what both do with it: take part in an outer step
(exchange.py), commit its hash, settle the data it read, catch up from peers when it is behind
(catch_up.py), and keep serving a while at the end. The modes (blocking.py, overlapped.py) decide
when; this decides nothing about time."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import torch

from elastic_mesh import CoordinatorError, ElasticDeviceMesh, node_hash
from prime.diloco.catch_up import CatchUp
from prime.diloco.config import DilocoConfig
from prime.diloco.error_feedback import ErrorFeedback
from prime.diloco.exchange import Exchange, Pace, exchange
from prime.diloco.faults import NoFaults, OuterStepFaults
from prime.diloco.outer_optimizer import OuterOptimizer, local_shards
from prime.diloco.publisher import SnapshotPublisher
from prime.diloco.trainer_view import TrainerView

log = logging.getLogger(__name__)

# A node the coordinator drops again and again while it rejoins and catches up (each time a stall longer
# than the lease) gives up after this many in a row: something else is wrong with it or its link.
DROPS_IN_A_ROW = 5


def _amount(nbytes: int) -> str:
    """Bytes for a person: a sparse outer step sends kilobytes where int8 sends megabytes."""
    return f"{nbytes / 1e6:.2f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.1f} kB"


class DilocoReplica:
    def __init__(self, model: torch.nn.Module, mesh: ElasticDeviceMesh, config: DilocoConfig,
                 outer: OuterOptimizer, work_dir: Path, faults: OuterStepFaults | None = None,
                 error_feedback: ErrorFeedback | None = None) -> None:
        self.model, self.mesh, self.config, self.outer = model, mesh, config, outer
        self.error_feedback = error_feedback  # diloco.compression = sparse
        self.faults = faults or NoFaults()
        # verified chunks of an interrupted download survive a restart here
        self.catch_up = CatchUp(model, mesh, config, outer, Path(work_dir))
        self.publisher = SnapshotPublisher(model, mesh, config, outer, self.faults)
        self.outer_step = 0  # the last committed outer step whose state this node holds
        self.tokens_contributed = 0  # tokens of this node's rounds that entered a committed average
        self.tokens_at_sync = 0

    def start(self, trainer: TrainerView, abandon: Callable[[], None]) -> None:
        """At the loop's start: a node resumed at the run's newest step serves it; one whose weights are
        stale (a running job, or an older checkpoint) catches up from its peers first."""
        committed, restored = self.mesh.joined["committed_round"], self.outer_step
        if restored and restored == committed:  # resumed from a checkpoint of the run's newest step
            self.publisher.publish(restored, None, trainer.optimizer)  # others resumed may hold older checkpoints
            trainer.progress.note(f"resumed at outer step {restored} (the run's newest), hash "
                                  f"{node_hash(self.outer.digest())}")
        elif committed > 0:
            trainer.metrics.write(self.rejoining(trainer, lambda: self.catch_up_now(trainer, full=not restored),
                                                 abandon))

    def catch_up_now(self, trainer: TrainerView, full: bool) -> dict:
        """Reaches the run's newest committed step from peers (catch_up.py), nobody waiting for this node."""
        self.publisher.wait()
        self.catch_up.outer_step = self.outer_step
        try:
            record = self.catch_up.run(trainer, full)
        finally:  # also when it is cut short: the outer params hold the step it reached, and the next try starts there
            self.outer_step = self.catch_up.outer_step
            self.outer.forget_others()
        self.tokens_at_sync = trainer.tokens_seen
        return record

    def rejoining(self, trainer: TrainerView, action: Callable[[], dict | None],
                  abandon: Callable[[], None]) -> dict | None:
        """action() (a round, or a catch-up), joining again and catching up from peers whenever the
        coordinator turns out to have dropped this node meanwhile. A stall longer than the lease (swap, a
        preempted VM, SIGSTOP) gets a node declared dead at any moment, and it learns so from whichever
        request comes next: the exchange, or the commit of its hash right after, or a catch-up's sources,
        will-join or long-poll. Each rejoins; a node dropped again while catching up goes round again.
        abandon(): drops the outer steps the mode has in flight (a dropped node's are void)."""
        for attempt in range(1, DROPS_IN_A_ROW + 1):
            try:
                return action()
            except CoordinatorError as e:
                if not e.dropped or attempt == DROPS_IN_A_ROW:
                    raise
                log.warning("%s was dropped by the coordinator (%s); joining again and catching up from peers",
                            self.mesh.name, e)
                abandon()
                action = lambda: self.out_of_step(trainer, Exchange(self.outer_step, "dropped"))  # noqa: E731
        raise AssertionError("unreachable")

    def exchange(self, mesh: ElasticDeviceMesh, step: int, pseudo: torch.Tensor, data: list[dict],
                 contributes: bool = True, pace: Pace | None = None, fragment: int | None = None) -> Exchange:
        """Outer step `step` for the fragment's pseudo-gradient (None: the whole model). With error
        feedback, what goes out is the pseudo-gradient plus the residual, and the residual is settled
        once the step is applied (error_feedback.py)."""
        feedback, span = self.error_feedback, self.outer.span(fragment)
        offered = feedback.compensate(pseudo, span) if feedback is not None and contributes else pseudo
        done = exchange(mesh, step, offered, data, self.config.wire_format, self.config.outlier_factor,
                        lambda phase: self.faults.allreduce_phase(step, phase), contributes, pace)
        if feedback is not None and done.status == "applied":
            feedback.settle(span, offered, done.result.sent)
        return done

    def out_of_step(self, trainer: TrainerView, exchange: Exchange) -> dict:
        """The coordinator went on without this node (or dropped it): this round's work is thrown away and
        the node catches up from its peers, without anyone waiting for it."""
        if exchange.status == "dropped":
            self.mesh.rejoin()  # the background view sees the new session and heartbeat too
            self.settle_data(trainer, "forget")
            return self.catch_up_now(trainer, full=False)  # its own state may still be good: replay onto it
        self.settle_data(trainer, "rewind")
        return self.catch_up_now(trainer, full=exchange.status == "resync")

    def commit(self, mesh: ElasticDeviceMesh, step: int) -> str:
        model_hash = mesh.node_hash(self.outer.digest())
        commit = mesh.rounds.commit(step, model_hash)
        if commit.get("status") == "diverged":
            log.error("%s: model hash %s differs from the run's %s at outer step %d; resyncing", mesh.name,
                      model_hash, commit.get("majority_hash"), step)
        return model_hash

    def round_data(self, trainer: TrainerView, mark: bool = False) -> list[dict]:
        """What every worker of this node read this round; the coordinator records it with the step."""
        if trainer.leased is None:
            return [r for worker in self.mesh.gather([]) for r in worker]
        mine = trainer.leased.mark() if mark else trainer.leased.report()
        return [r for worker in self.mesh.gather(mine) for r in worker]

    def record(self, trainer: TrainerView, exchange: Exchange, model_hash: str, waited_s: float,
               fragment: int | None = 0, lag: int = 0) -> dict:
        """The metrics record of an applied outer step, and its progress line. lag: inner steps between
        the launch of an overlapped outer step and its application."""
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
            f"{_amount(result.bytes_sent)} sent, {'inner steps waited' if late else 'round'} {waited_s:.2f} s, "
            f"hash {model_hash}")
        return record

    def outer_state(self, step: int) -> dict[str, torch.Tensor]:
        """Saved with every checkpoint: what a resumed node needs besides the model and inner optimizer
        (`step`: the last outer step applied to the outer params)."""
        state = {"diloco_state": self.outer.state_tensor(), "diloco_outer_step": torch.tensor(step)}
        if self.error_feedback is not None:
            state["diloco_error_feedback"] = self.error_feedback.state_tensor()
        return state

    def finish(self, trainer: TrainerView, ended_on: int) -> None:
        """After the last step (the run ended on outer step `ended_on`): keeps serving a while, so a node
        still catching up can finish too."""
        if self.outer_step != ended_on:
            self.outer_step = ended_on
            self.outer.copy_to(local_shards(self.model))
        if not self.config.serve_snapshots:
            return
        self.publisher.wait()
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

    def settle_data(self, trainer: TrainerView, outcome: str) -> None:
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
