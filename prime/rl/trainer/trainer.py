"""The RL trainer (trusted): takes GRPO batches from the orchestrator, steps the policy, checkpoints,
and publishes each new version through the broadcast.

Version v is the policy after v steps (v0: the policy it started from). The trainer publishes each
version as soon as it is trained and writes a checkpoint (model and optimizer, DCP, in the background)
every `checkpoint_every` steps, so a trainer killed at any point and restarted with the same arguments
resumes from its last checkpoint: it asks the orchestrator for the same batches again (the orchestrator
keeps the last checkpoint_every + 1, as the trainer tells it), trains them again, and republishes a
version the coordinator lacks.

Under `torchrun --nproc-per-node N` the policy is sharded with FSDP2 over the N local ranks and each
batch split between them (prime.rl.update.sharded_update: the same step as one process); local rank 0
alone talks to the orchestrator and the broadcast, and gathers the full weights to publish them.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from elastic_mesh import BroadcastError, BroadcastMember, CoordinatorClient, CoordinatorError
from prime.core.checkpoint import CheckpointStore
from prime.core.distributed import LocalGroup, broadcast_json, close_local_group, init_local_group
from prime.core.optim import build_optimizer
from prime.core.parallelize import parallelize
from prime.inference.hf_engine import load_hf_policy
from prime.rl.token_flags import ORCHESTRATOR_SERVICE
from prime.rl.trainer.config import RLTrainerConfig
from prime.rl.transport.batches import BatchSource, OrchestratorBatches
from prime.rl.transport.policy_files import POLICY_KIND, policy_broadcast_settings
from prime.rl.transport.weights import BroadcastPublisher, RetryingPublisher, WeightPublisher
from prime.rl.update import Row, sharded_update
from prime.verify.thresholds import ToplocThresholds

log = logging.getLogger("prime.rl.trainer")


class RLTrainer:
    """One trainer process (one local rank under torchrun). weights and batches: local rank 0's
    connections to the run (None on the other local ranks, which only compute)."""

    def __init__(self, config: RLTrainerConfig, model, group: LocalGroup, run_dir: Path,
                 weights: WeightPublisher | None, batches: BatchSource | None, member: BroadcastMember | None = None,
                 reference=None) -> None:
        self.config, self.model, self.group, self.run_dir = config, model, group, Path(run_dir)
        self.weights, self.batches, self.member, self.reference = weights, batches, member, reference
        self.rank, self.world = group.rank, group.world_size
        self.optimizer, self.scheduler = build_optimizer(model, config.optim, config.max_steps)
        self.store = CheckpointStore(self.run_dir / "checkpoints", keep=config.checkpoint_keep, rank=self.rank,
                                     world_size=self.world)
        self.step = self.saved = 0
        self.published = -1  # the newest version the run holds, as this trainer knows it
        self.idle_s, self.started = 0.0, time.monotonic()
        self.pad_id = int(model.config.pad_token_id or 0)

    @classmethod
    def build(cls, config: RLTrainerConfig, token: str, policy: Path, orchestrator: str, run_dir: Path,
              advertise_host: str | None = None) -> "RLTrainer":
        """Loads the policy, joins the broadcast and connects to the orchestrator (local rank 0)."""
        ToplocThresholds.load(policy)  # workers cannot be verified without it: fail here, not in the orchestrator
        group = init_local_group("cpu")
        if group.rank != 0:  # one voice per trainer: the other local ranks only speak up about trouble
            logging.getLogger().setLevel(logging.WARNING)
        torch.manual_seed(0)
        model = load_hf_policy(policy)
        policy_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # what each version carries
        reference = copy.deepcopy(model).eval() if config.grpo.kl_coef > 0 else None
        model = parallelize(model, group.device, group.world_size, torch.float32, activation_checkpointing=False)
        member = weights = batches = None
        if group.rank == 0:  # the other local ranks only compute: the batch reaches them over the local group
            try:
                member = BroadcastMember(token, POLICY_KIND, Path(run_dir) / "broadcast",
                                         policy_broadcast_settings(keep=3, advertise_host=advertise_host,
                                                                   payload_bytes=policy_bytes))
            except BroadcastError as e:
                raise SystemExit(f"cannot join the run: {e}") from None
            if not member.may_publish:
                member.stop()
                raise SystemExit("this token has no publish right: the trainer publishes the policy "
                                 "(token create --publish)")
            weights = RetryingPublisher(BroadcastPublisher(member, policy, {"orchestrator": orchestrator},
                                                           getattr(torch, config.publish_dtype)))
            client = CoordinatorClient(orchestrator, request_timeout_s=60, retry_s=120, bearer=token,
                                       tls=member.client.tls_context(), service=ORCHESTRATOR_SERVICE)
            batches = OrchestratorBatches(client, keep=config.checkpoint_every + 1)
        return cls(config, model, group, run_dir, weights, batches, member, reference)

    # ---- the loop ----------------------------------------------------------------------------------
    def run(self) -> int:
        """Trains until max_steps or until the orchestrator ends the run; 0 when done."""
        self._resume()
        # The run is asked for its newest version once, at the start (a restarted trainer may find its next
        # version there already); after that this trainer is the only publisher and knows it.
        self.published = broadcast_json(self.weights.newest() if self.rank == 0 else None, self.rank, self.world)
        self._publish(self.step)
        metrics = self._open_metrics()
        self.idle_s, self.started = 0.0, time.monotonic()
        try:
            while self.step < self.config.max_steps:
                batch = self._next_batch()
                if batch is None:
                    log.info("the orchestrator ended the run at step %d", self.step)
                    break
                record = self._train(batch)
                if metrics is not None:
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
            if self.saved != self.step:  # the policy the run ended with, for export
                self._save()
            if self.batches is not None:
                self.batches.finish(self.step)
        except CoordinatorError as e:
            raise SystemExit(f"the orchestrator refused the trainer: {e}") from None
        finally:
            if metrics is not None:
                metrics.close()
        log.info("trainer done: %d steps, idle %.0f%% of %.0f s", self.step, 100 * self._idle_fraction(),
                 time.monotonic() - self.started)
        return 0

    def _next_batch(self) -> dict | None:
        waited = time.monotonic()
        ask = self.step + 1 < self.config.max_steps
        batch = broadcast_json(self.batches.get(self.step, prefetch=ask) if self.rank == 0 else None,
                               self.rank, self.world)
        self.idle_s += time.monotonic() - waited
        return batch

    def _train(self, batch: dict) -> dict:
        """One step on `batch`, its version published, a checkpoint when due; returns the step's record."""
        began = time.monotonic()
        rows = [Row(r["prompt"], r["tokens"], r["logprobs"], float(r["advantage"])) for r in batch["rows"]]
        stats = sharded_update(self.model, self.optimizer, rows, self.config.grpo, float(batch["temperature"]),
                               self.pad_id, self.rank, self.world, self.config.epochs, self.config.max_grad_norm,
                               self.reference)
        self.scheduler.step()
        self.step += 1
        trained = time.monotonic()
        # Published before any checkpoint is taken: every worker waits for the new version, nobody for the
        # checkpoint. A trainer killed before its next checkpoint resumes from the last one, trains the steps
        # since again on the same batches (the orchestrator keeps them) and finds their versions published.
        self._publish(self.step)
        published_at, publishing_done = time.time(), time.monotonic()
        if self.step % self.config.checkpoint_every == 0 or self.step == self.config.max_steps:
            self._save()
        elapsed = time.monotonic() - self.started
        record = {"step": self.step, "time_s": round(elapsed, 3), "train_s": round(time.monotonic() - began, 4),
                  "update_s": round(trained - began, 4), "publish_s": round(publishing_done - trained, 4),
                  "save_s": round(time.monotonic() - publishing_done, 4), "published_at": round(published_at, 3),
                  "idle_fraction": round(self._idle_fraction(), 4),
                  **{k: v for k, v in batch["stats"].items() if k != "prompt_numbers"}, **stats}
        if self.rank == 0 and (self.step % 10 == 0 or self.step == self.config.max_steps):
            log.info("step %d/%d: batch reward %.3f, %d rows, staleness %.1f (max %d), idle %.0f%%", self.step,
                     self.config.max_steps, batch["stats"]["reward_mean"], len(rows),
                     batch["stats"]["staleness_mean"], batch["stats"]["staleness_max"], 100 * record["idle_fraction"])
        return record

    def _publish(self, version: int) -> None:
        """Publishes `version` unless the run already holds it (a restarted trainer). Every local rank
        calls it: the full weights are gathered from the shards (a collective), local rank 0 publishes."""
        if self.published >= version:
            if self.rank == 0:
                log.info("version %d is already published (newest %d)", version, self.published)
            return
        weights = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            self.weights.publish(version, self.model, weights)
        self.published = version

    # ---- state -------------------------------------------------------------------------------------
    def _resume(self) -> None:
        latest = self.store.latest()
        if latest is None:
            return
        state, _ = self.store.load(latest, self.model, self.optimizer)
        self.step = self.saved = int(state["step"])
        self.scheduler.last_epoch = self.step
        log.info("resumed from %s: step %d", latest.name, self.step)

    def _save(self) -> None:
        self.store.save(self.step, self.model, self.optimizer, {"step": self.step}, {})
        self.saved = self.step

    def _open_metrics(self):
        """metrics.jsonl (local rank 0), after dropping the records of steps this resumed trainer trains again."""
        if self.rank != 0:
            return None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        dropped = drop_records_after(path, self.step)
        if dropped:
            log.info("%d step records after step %d left metrics.jsonl: those steps are trained again", dropped,
                     self.step)
        return path.open("a")

    def _idle_fraction(self) -> float:
        return self.idle_s / max(time.monotonic() - self.started, 1e-9)

    def close(self) -> None:
        if self.batches is not None:
            self.batches.close()
        self.store.wait()
        if self.member is not None:
            self.member.stop()
        close_local_group()


def drop_records_after(path: Path, step: int) -> int:
    """A trainer resumed from the checkpoint of `step` trains the steps after it again: their records, and
    a last line that the stop cut short, leave the log, so it holds each step once. Returns how many left."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            dropped += 1
            continue
        if int(record.get("step", 0)) <= step:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        staging = path.with_suffix(".jsonl.tmp")
        staging.write_text("".join(kept))
        staging.replace(path)
    return dropped
