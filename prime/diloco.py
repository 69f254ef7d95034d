"""DiLoCo's outer loop: pseudo-gradients, the compressed all-reduce, the outer Nesterov step.

It attaches to the plain inner loop as a StepHook and runs every `inner_steps` steps (the `blocking`
mode: communication is not overlapped with compute). Each local rank owns fp32 CPU copies of its FSDP2
shards (the outer params); its global group pairs it with the same shard on every other node.

The round is all-or-nothing: the pseudo-gradients stay intact until the coordinator says every
member's all-reduce succeeded ("apply"); on "abort" the same pseudo-gradients go into a retry with the
survivors. A node never applies its own pseudo-gradient alone.
"""

from __future__ import annotations

import hashlib
import logging
import time

import torch
import torch.distributed as dist

from elastic_mesh.codecs import codec_for
from elastic_mesh.collectives import CollectiveError, all_reduce_mean
from elastic_mesh.client import CoordinatorError
from elastic_mesh.mesh import ElasticDeviceMesh, StepPlan, node_hash
from prime.chaos import ChaosConfig, kill_node, take_command
from prime.diloco_config import DilocoConfig

log = logging.getLogger(__name__)


def local_shards(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's piece of every parameter (the local shard of an FSDP2 DTensor, or the tensor itself)."""
    return [p.to_local() if hasattr(p, "to_local") else p.data for p in model.parameters()]


class OuterOptimizer:
    """Outer params (fp32, CPU) and Nesterov SGD over them, for this rank's shards."""

    def __init__(self, shards: list[torch.Tensor], lr: float, momentum: float) -> None:
        self.outer = [s.detach().float().cpu().clone() for s in shards]
        self.sizes = [t.numel() for t in self.outer]
        self.optimizer = torch.optim.SGD(self.outer, lr=lr, momentum=momentum, nesterov=momentum > 0)

    def pseudo_gradient(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """outer − inner, flattened (one collective for all parameters)."""
        if not self.outer:
            return torch.zeros(0)
        return torch.cat([(o - s.detach().float().cpu()).reshape(-1) for o, s in zip(self.outer, shards)])

    def step(self, mean_pseudo_gradient: torch.Tensor, shards: list[torch.Tensor]) -> None:
        for o, g in zip(self.outer, mean_pseudo_gradient.split(self.sizes)):
            o.grad = g.view_as(o).clone()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.copy_to(shards)

    def copy_to(self, shards: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for o, s in zip(self.outer, shards):
                s.copy_(o.view_as(s).to(device=s.device, dtype=s.dtype))

    def state_tensor(self) -> torch.Tensor:
        """Outer params then momentum buffers, flat: what a joiner needs."""
        momentum = [self.optimizer.state.get(o, {}).get("momentum_buffer") for o in self.outer]
        flat = [o.reshape(-1) for o in self.outer]
        flat += [(m if m is not None else torch.zeros_like(o)).reshape(-1) for m, o in zip(momentum, self.outer)]
        return torch.cat(flat) if flat else torch.zeros(0)

    def load_state_tensor(self, state: torch.Tensor) -> None:
        total = sum(self.sizes)
        with torch.no_grad():
            for o, piece in zip(self.outer, state[:total].split(self.sizes)):
                o.copy_(piece.view_as(o))
            for o, piece in zip(self.outer, state[total:].split(self.sizes)):
                self.optimizer.state[o]["momentum_buffer"] = piece.view_as(o).clone()

    def digest(self) -> bytes:
        h = hashlib.blake2b(digest_size=32)
        for o in self.outer:
            h.update(o.numpy().tobytes())
        return h.digest()


class DilocoHook:
    """Runs the outer step every H inner steps; joins a running job at an outer-step boundary."""

    def __init__(self, model: torch.nn.Module, mesh: ElasticDeviceMesh, config: DilocoConfig,
                 outer: OuterOptimizer, chaos: ChaosConfig | None = None) -> None:
        self.model, self.mesh, self.config, self.outer = model, mesh, config, outer
        self.chaos = chaos or ChaosConfig()
        self.codec = codec_for(config.compression)
        self.outer_step = mesh.joined["committed_step"]
        # A node that joins after step 0 holds stale weights: it takes the state from a peer first.
        self.needs_state = self.outer_step > 0
        self.contributing = not self.needs_state
        self.tokens_contributed = 0  # tokens of this node's rounds that entered a committed average
        self._tokens_at_sync = 0

    def on_start(self, trainer) -> None:
        if self.needs_state:
            record = self._round(trainer)
            trainer.metrics.write(record)

    def after_step(self, trainer, step: int) -> dict | None:
        if self.chaos.kill_at_inner_step and step == self.chaos.kill_at_inner_step:
            kill_node(f"inner step {step}")
        if self.chaos.step_delay_s:
            time.sleep(self.chaos.step_delay_s)
        if step % self.config.inner_steps:
            return None
        return self._round(trainer)

    def _round(self, trainer) -> dict:
        started = time.perf_counter()
        shards = local_shards(self.model)
        step = self.outer_step + 1
        pseudo = self.outer.pseudo_gradient(shards) if self.contributing else torch.zeros(sum(self.outer.sizes))
        if self.chaos.nan_at_outer_step == step or (self.contributing and take_command(self.chaos, "nan")):
            pseudo[: max(1, pseudo.numel() // 100)] = float("nan")
        while True:
            if self.mesh.dropped:
                log.warning("%s was dropped by the coordinator; joining again and taking the state from a peer",
                            self.mesh.name)
                self.mesh.rejoin(self.mesh.node_facts)
                self.needs_state, self.contributing = True, False
                step = self.mesh.joined["committed_step"] + 1
                pseudo = torch.zeros(sum(self.outer.sizes))
            plan = self.mesh.plan(step, self.contributing, self.needs_state)
            if plan.status in ("missed", "resync"):
                log.warning("%s: outer step %d %s; its work is dropped, the state comes from a peer",
                            self.mesh.name, step, "went on without this node" if plan.status == "missed" else
                            "showed this node diverged")
                self.needs_state, self.contributing = True, False
                step = plan.committed_step + 1
                pseudo = torch.zeros(sum(self.outer.sizes))
                continue
            result, ok, blame = None, True, []
            try:
                if not self.mesh.agree(True):
                    raise CollectiveError("another local rank failed before the transfer", "start")
                pg = self.mesh.group(plan)
                if plan.syncing:
                    self._sync_state(pg, plan)
                    pseudo = torch.zeros_like(pseudo) if plan.rank in plan.syncing else pseudo
                valid = self.mesh.agree(bool(torch.isfinite(pseudo).all()))
                result = all_reduce_mean(pg, pseudo, self.codec, plan.contributes, valid=valid,
                                         outlier_factor=self.config.outlier_factor, on_phase=self._fault(step))
            except (CollectiveError, CoordinatorError, RuntimeError) as e:
                ok, blame = False, getattr(e, "blame", [])
                log.warning("%s: outer step %d attempt %d failed: %s", self.mesh.name, step, plan.attempt,
                            str(e).splitlines()[0][:200])
            ok = self.mesh.agree(ok)
            refused = result.refused if result else {}
            seconds = result.seconds if result else 0.0
            if self.mesh.vote(plan, ok, refused, blame, seconds) == "apply" and ok:
                break
            self.mesh.drop_group(plan.epoch)
            log.warning("%s: outer step %d will be retried with the pseudo-gradients kept", self.mesh.name, step)

        for rank, why in result.refused.items():
            log.warning("%s: outer step %d refused %s's pseudo-gradient: %s", self.mesh.name, step,
                        plan.members[rank]["name"], why)
        self.outer.step(result.mean, shards)
        if plan.rank in result.contributors:
            self.tokens_contributed += trainer.tokens_seen - self._tokens_at_sync
        self._tokens_at_sync = trainer.tokens_seen
        joined_now = self.needs_state
        self.outer_step, self.needs_state, self.contributing = step, False, True
        if joined_now or trainer.step != step * self.config.inner_steps:
            trainer.jump_to_step(step * self.config.inner_steps)
        model_hash = node_hash(self.outer.digest())
        commit = self.mesh.commit(step, model_hash)
        if commit.get("status") == "diverged":
            log.error("%s: model hash %s differs from the run's %s at outer step %d; resyncing", self.mesh.name,
                      model_hash, commit.get("majority_hash"), step)
        elapsed = time.perf_counter() - started
        record = {"outer_step": step, "epoch": plan.epoch, "members": len(result.contributors),
                  "nodes": plan.world_size, "attempt": plan.attempt, "allreduce_s": round(result.seconds, 4),
                  "outer_s": round(elapsed, 4), "bytes_sent": result.bytes_sent,
                  "bytes_received": result.bytes_received, "model_hash": model_hash, "step": trainer.step,
                  "tokens_contributed": self.tokens_contributed,
                  "refused": [plan.members[r]["name"] for r in result.refused]}
        trainer.progress.note(f"outer step {step}: epoch {plan.epoch}, {len(result.contributors)}/{plan.world_size} "
                              f"nodes averaged, all-reduce {result.seconds:.2f} s, {result.bytes_sent / 1e6:.2f} MB "
                              f"sent, round {elapsed:.2f} s, hash {model_hash}")
        return record

    def _sync_state(self, pg, plan: StepPlan) -> None:
        """The members that lack the committed state receive it (outer params and momentum) from a peer."""
        state = self.outer.state_tensor()
        options = dist.BroadcastOptions()
        options.rootRank = plan.state_source
        pg.broadcast([state], options).wait()
        if plan.rank in plan.syncing:
            if not torch.isfinite(state).all():
                raise CollectiveError("the state received from a peer is not finite", "sync", [plan.state_source])
            self.outer.load_state_tensor(state)
            self.outer.copy_to(local_shards(self.model))

    def _fault(self, step: int):
        def on_phase(phase: str) -> None:
            if phase == "scatter" and (self.chaos.kill_in_allreduce_at == step
                                       or take_command(self.chaos, "kill-in-allreduce")):
                kill_node(f"between the phases of outer step {step}'s all-reduce")
        return on_phase
