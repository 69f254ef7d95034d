"""diloco.mode = blocking: every H inner steps the inner loop waits while the outer step is decided
(plan, all-reduce, vote), applied to the outer params and the model, committed and served."""

from __future__ import annotations

import time

import torch

from prime.diloco.outer_optimizer import local_shards
from prime.diloco.replica import DilocoReplica
from prime.diloco.trainer_view import TrainerView


class BlockingOuterLoop:
    """An OuterLoop (hook.py) whose outer steps hold the inner steps."""

    def __init__(self, replica: DilocoReplica) -> None:
        self.replica = replica

    def on_start(self, trainer: TrainerView) -> None:
        self.replica.start(trainer, abandon=lambda: None)

    def after_step(self, trainer: TrainerView, step: int) -> dict | None:
        if step % self.replica.config.inner_steps:
            return None
        return self.replica.rejoining(trainer, lambda: self._round(trainer), abandon=lambda: None)

    def on_end(self, trainer: TrainerView) -> None:
        self.replica.finish(trainer, self.replica.outer_step)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        self.replica.publisher.wait()
        return self.replica.outer_state(self.replica.outer_step)

    def _round(self, trainer: TrainerView) -> dict:
        r = self.replica
        started = time.perf_counter()
        r.publisher.wait()
        shards = local_shards(r.model)
        step = r.outer_step + 1
        pseudo = r.outer.pseudo_gradient(shards)
        data = r.round_data(trainer)
        r.faults.pseudo_gradient(pseudo, step)
        exchange = r.exchange(r.mesh, step, pseudo, data)
        if exchange.status != "applied":
            return r.out_of_step(trainer, exchange)
        r.faults.decided(step)
        r.outer.step(exchange.result.mean, shards)
        if r.config.inner_optimizer == "reset":
            trainer.optimizer.state.clear()  # AdamW builds fresh moments (and step 0) at its next step
        r.settle_data(trainer, "committed" if exchange.contributed else "rewind")
        if exchange.contributed:
            r.tokens_contributed += trainer.tokens_seen - r.tokens_at_sync
        r.tokens_at_sync = trainer.tokens_seen
        r.outer_step = step
        if trainer.step != step * r.config.inner_steps:
            trainer.jump_to_step(step * r.config.inner_steps)
        model_hash = r.commit(r.mesh, step)
        r.publisher.publish(step, exchange.result, trainer.optimizer)
        return r.record(trainer, exchange, model_hash, time.perf_counter() - started)
