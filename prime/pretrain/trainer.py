"""The inner training loop of one node: AdamW steps over packed sequences, eval, checkpoints, metrics.

The loop itself stays plain. Whatever happens between inner steps (DiLoCo's outer step, later) attaches
through `StepHook`, never through branches in the loop.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from prime.core.checkpoint import CheckpointStore
from prime.core.distributed import LocalGroup
from prime.core.flops import peak_flops
from prime.core.metrics import MetricsWriter
from prime.core.model import build_model, count_parameters, flops_per_token
from prime.core.optim import build_optimizer
from prime.core.parallelize import compute_dtype, parallelize, uses_fsdp
from prime.core.progress import ProgressDisplay
from prime.data.leased import LeasedSequenceStream
from prime.data.loader import (
    BatchIterator,
    DataPosition,
    PackedSequenceStream,
    eval_shards,
    train_and_eval_files,
    worker_shards,
)
from prime.data.shards import make_shards
from prime.data.tokenizer import load_tokenizer
from prime.pretrain.config import PretrainConfig

log = logging.getLogger(__name__)


class StepHook(Protocol):
    """Attaches to the loop: on_start once before the first step, after_step after every inner step
    (may change the model; returns a metrics record or None), on_end once after the last step."""

    def on_start(self, trainer: "Trainer") -> None: ...

    def after_step(self, trainer: "Trainer", step: int) -> dict | None: ...

    def on_end(self, trainer: "Trainer") -> None: ...


@dataclass(frozen=True)
class RunMembership:
    """What a multi-node run asks of the trainer it makes one of its replicas (prime/diloco/attach.py),
    handed over in one call (Trainer.join_run) instead of written into the trainer from outside."""

    name: str  # the node's name in the run: it prefixes this trainer's log lines
    run_id: str  # metrics runs are grouped by it
    hook: StepHook  # the outer loop
    checkpoint_tensors: Callable[[], dict[str, torch.Tensor]]  # its own state, saved with every checkpoint
    checkpoint_multiple: int  # checkpoints only at inner steps that are multiples (the ends of outer steps)
    sync_every: int  # inner steps between synchronisations (the progress display's rhythm)
    sink: Callable[[dict], None]  # every metrics record also goes here (the run's dashboard)
    lease: Callable[[list, bool], dict | None]  # the data lease: see lease_data
    worker: int  # the global rank leasing data


class Trainer:
    def __init__(self, config: PretrainConfig, group: LocalGroup, run_dir: Path, resume: bool = False,
                 quiet: bool = False, hooks: list[StepHook] | None = None) -> None:
        config.check_world(group.world_size)
        self.config, self.group, self.run_dir = config, group, Path(run_dir)
        self.hooks = hooks or []
        self.prefix = "[node]"
        self.tokenizer = load_tokenizer(config.data.tokenizer)
        config.check_tokenizer(self.tokenizer.vocab_size, self.tokenizer.eos_id)
        self.dtype = compute_dtype(config.train.precision, group.device)
        self.accumulation = config.grad_accumulation_steps(group.world_size)

        model = build_model(config.model, config.train.seed, group.device)
        self.num_params = count_parameters(model)
        self.model = parallelize(model, group.device, group.world_size, self.dtype,
                                 config.train.activation_checkpointing, config.train.shard_single_rank)
        self.sharded = uses_fsdp(group.world_size, config.train.shard_single_rank)
        self.optimizer, self.scheduler = build_optimizer(self.model, config.optim, config.train.max_steps)
        self.checkpoints = CheckpointStore(Path(config.checkpoint.dir or self.run_dir / "checkpoints"),
                                           config.checkpoint.keep, group.rank, group.world_size,
                                           config.checkpoint.background, config.checkpoint.remote)
        self.step, self.tokens_seen, self._position = 0, 0, {}  # a DataPosition's dict
        self.restored: Path | None = None  # the checkpoint this run resumed from
        # Hooks add state of their own to every checkpoint (name -> tensor), e.g. DiLoCo's outer optimizer.
        self.checkpoint_tensors: list = []
        self.checkpoint_multiple = 1  # checkpoints only at steps that are multiples (DiLoCo: outer-step ends)
        if resume:
            self._position = self._restore()
        self.train_files, self.eval_files = train_and_eval_files(config.data)
        self._batches: BatchIterator | None = None
        self.leased: LeasedSequenceStream | None = None

        self.flops_per_token = flops_per_token(config.model, config.train.seq_len)
        self.peak = config.train.peak_tflops * 1e12 if config.train.peak_tflops else peak_flops(group.device, self.dtype)
        self.metrics = MetricsWriter(self.run_dir, config.metrics, config.name, enabled=group.is_leader,
                                     wandb_config=config.model_dump())
        self.progress = ProgressDisplay(config.train.max_steps, self.step, enabled=group.is_leader,
                                        quiet=quiet or not config.metrics.progress, every=config.train.log_every,
                                        prefix=self.prefix)
        self.metrics.sinks.append(self.progress.observe)
        if group.is_leader:
            log.info("%s model %.2fM params, %d local rank(s) on %s, %s, batch %d × %d tokens, %d accumulation step(s)",
                     self.prefix, self.num_params / 1e6, group.world_size, group.device, self.dtype,
                     config.train.batch_size, config.train.seq_len, self.accumulation)

    def add_hook(self, hook: StepHook, first: bool = False) -> None:
        """first: before the hooks already attached (a fault that kills at inner step k must strike before
        that step's outer step)."""
        self.hooks.insert(0, hook) if first else self.hooks.append(hook)

    def join_run(self, membership: RunMembership) -> None:
        """Makes this trainer one replica of a multi-node run: the run's outer loop after every step, its
        state in every checkpoint, data leased from the run, logs named after the node."""
        self.add_hook(membership.hook)
        self.checkpoint_tensors.append(membership.checkpoint_tensors)
        self.checkpoint_multiple = membership.checkpoint_multiple
        self.metrics.sinks.append(membership.sink)
        self.lease_data(membership.lease, membership.worker)
        self.prefix = self.progress.prefix = f"[{membership.name}]"
        self.progress.sync_every = membership.sync_every
        self.metrics.name_run(membership.name, group=membership.run_id)

    def lease_data(self, lease, worker: int) -> LeasedSequenceStream:
        """Reads shards leased from the coordinator instead of a fixed slice (a multi-node run): see
        prime/data/leased.py. `lease(held, spare)` returns {"item", "pass", "cursor"}, {"item": None} (no
        spare shard free) or None (this node was dropped)."""
        if self._batches is not None:
            raise RuntimeError("data leases must be set up before training starts")
        data = self.config.data
        self.leased = LeasedSequenceStream(make_shards(self.train_files, data.parts_per_file), self.tokenizer,
                                           self.config.train.seq_len, data.text_field, lease, worker,
                                           interleave=data.interleave, seed=data.seed)
        return self.leased

    def restart_data(self) -> None:
        """The next batch comes from the stream's current (e.g. rewound) position."""
        self._batches = None

    def prepare_data(self) -> None:
        """Reads the next micro-batch ahead, so the next step does not also lease and open the shards it
        reads (data.interleave of them: 0.7 s for a joiner's first step on loopback, every other node
        waiting for it at the round it joins). Leased data only: a checkpoint's data position would
        skip the batch read ahead."""
        if self.leased is not None:
            self.batches.read_ahead()

    @property
    def batches(self) -> BatchIterator:
        if self._batches is None:
            stream = self.leased
            if stream is None:
                shards = worker_shards(self.config.data, self.train_files, self.group.rank, self.group.world_size)
                data = self.config.data
                position = DataPosition.from_dict(self._position, len(shards)) if self._position else None
                stream = PackedSequenceStream(shards, self.tokenizer, self.config.train.seq_len, data.text_field,
                                              position, interleave=data.interleave, seed=data.seed)
            self._batches = BatchIterator(stream, self.config.train.micro_batch_size)
        return self._batches

    def jump_to_step(self, step: int) -> None:
        """Moves the step counter and the LR schedule (a node that joined takes the run's position)."""
        self.step = step
        self.scheduler.last_epoch = step - 1
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": deliberate here
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()

    def _restore(self) -> dict:
        latest = self.checkpoints.latest()
        if latest is None:
            log.info("%s --resume: no checkpoint in %s yet, starting from step 0", self.prefix, self.checkpoints.root)
            return {}
        trainer_state, rank_state = self.checkpoints.load(latest, self.model, self.optimizer)
        self.scheduler.load_state_dict(trainer_state["scheduler"])
        self.step, self.tokens_seen = trainer_state["step"], trainer_state["tokens_seen"]
        self.restored = latest
        log.info("%s resumed from %s at step %d", self.prefix, latest, self.step)
        return rank_state.get("data") or {}

    def save_checkpoint(self) -> Path:
        trainer_state = {"step": self.step, "tokens_seen": self.tokens_seen,
                         "scheduler": self.scheduler.state_dict(), "config": self.config.model_dump(mode="json")}
        # A multi-node run's data position lives in the coordinator's ledger, not in the node's checkpoint.
        data = self.batches.position.to_dict() if self.leased is None else None
        tensors = {k: v for provide in self.checkpoint_tensors for k, v in provide().items()}
        started = time.perf_counter()
        path = self.checkpoints.save(self.step, self.model, self.optimizer, trainer_state, {"data": data}, tensors)
        paused = time.perf_counter() - started
        how = "being written in the background" if self.config.checkpoint.background else "written"
        self.progress.note(f"checkpoint step {self.step} {how} to {path} (training paused {paused:.2f} s)")
        self.metrics.write({"step": self.step, "checkpoint_pause_s": round(paused, 4)})
        return path

    def _loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        autocast = self.dtype != torch.float32 and not self.sharded  # FSDP2's policy casts when sharded
        with torch.autocast(self.group.device.type, dtype=self.dtype, enabled=autocast):
            logits = self.model(input_ids=inputs).logits
        logits = logits.float()  # (B, T, V); the loss is always computed in fp32
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        if self.config.train.z_loss == 0:
            return ce, ce
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        return ce + self.config.train.z_loss * z, ce

    def train_step(self) -> dict:
        """One optimizer step over `batch_size` sequences of this node."""
        started = time.perf_counter()
        self.model.train()
        ce_sum = torch.zeros((), device=self.group.device)
        for micro in range(self.accumulation):
            inputs, labels = (t.to(self.group.device, non_blocking=True) for t in next(self.batches))
            if hasattr(self.model, "set_requires_gradient_sync"):
                # Reduce-scatter gradients once per step, not once per micro-batch.
                self.model.set_requires_gradient_sync(micro == self.accumulation - 1)
            loss, ce = self._loss(inputs, labels)
            (loss / self.accumulation).backward()
            ce_sum += ce.detach()
        clip = self.config.train.grad_clip
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else math.inf)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        stats = torch.stack([ce_sum / self.accumulation, grad_norm.to(ce_sum)])
        if self.group.world_size > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.AVG)
        self.step += 1
        tokens = self.config.train.batch_size * self.config.train.seq_len
        self.tokens_seen += tokens
        elapsed = time.perf_counter() - started
        tokens_per_s = tokens / elapsed
        loss_value = stats[0].item()
        if not math.isfinite(loss_value):
            raise FloatingPointError(
                f"loss became {loss_value} at step {self.step}; lower optim.lr or raise optim.warmup_steps, "
                "then resume from the last checkpoint with --resume"
            )
        mfu = tokens_per_s * self.flops_per_token / (self.peak * self.group.world_size) if self.peak else None
        return {"step": self.step, "loss": round(loss_value, 5), "lr": lr, "grad_norm": round(stats[1].item(), 4),
                "tokens": self.tokens_seen, "tokens_per_s": round(tokens_per_s, 1),
                "mfu": round(mfu, 4) if mfu is not None else None, "step_s": round(elapsed, 4)}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss on the held-out split; every call sees the same sequences."""
        self.model.eval()
        shards = eval_shards(self.eval_files, self.group.rank, self.group.world_size)
        stream = PackedSequenceStream(shards, self.tokenizer, self.config.train.seq_len,
                                      self.config.data.text_field, loop=True)
        batches = BatchIterator(stream, self.config.train.micro_batch_size)
        total = torch.zeros((), device=self.group.device)
        for _ in range(self.config.train.eval_batches):
            inputs, labels = (t.to(self.group.device) for t in next(batches))
            total += self._loss(inputs, labels)[1]
        total /= self.config.train.eval_batches
        if self.group.world_size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.AVG)
        return total.item()

    def run(self) -> dict:
        """Trains to train.max_steps; returns the last step's record (with the last eval loss)."""
        train, every = self.config.train, self.config.checkpoint.every
        record: dict = {}
        for hook in self.hooks:
            hook.on_start(self)
        while self.step < train.max_steps:
            record = self.train_step()
            for hook in self.hooks:
                extra = hook.after_step(self, self.step)
                if extra:
                    self.metrics.write(extra)
            last = self.step == train.max_steps
            if (train.eval_every and self.step % train.eval_every == 0) or last:
                record["eval_loss"] = round(self.evaluate(), 5)
                self.metrics.write({"step": self.step, "eval_loss": record["eval_loss"], "tokens": self.tokens_seen})
                self.progress.note(f"step {self.step} eval_loss {record['eval_loss']:.4f}")
            self.metrics.write({k: v for k, v in record.items() if k != "eval_loss"})
            if ((every and self.step % every == 0) or last) and self.step % self.checkpoint_multiple == 0:
                self.save_checkpoint()
        self.checkpoints.wait()  # the last checkpoint is complete when the run returns
        for hook in self.hooks:
            hook.on_end(self)
        return record

    def close(self) -> None:
        self.checkpoints.wait()
        self.progress.close()
        self.metrics.close()
