"""Makes a trainer one DiLoCo replica of a multi-node run: join with a token, attach the outer loop."""

from __future__ import annotations

import logging
import socket

import torch.distributed as dist

from elastic_mesh.mesh import ElasticDeviceMesh, node_hash
from prime.config import JobConfig
from prime.data.shards import data_fingerprint, make_shards
from prime.diloco.faults import OuterStepFaults
from prime.diloco.hook import DilocoHook
from prime.diloco.outer_optimizer import OuterOptimizer, local_shards
from prime.pretrain.trainer import Trainer

log = logging.getLogger(__name__)


def _dashboard_sink(mesh: ElasticDeviceMesh, inner_steps: int):
    def publish(record: dict) -> None:
        # Right after an outer step the model is the outer model: its eval loss is the run's.
        if "eval_loss" in record and record.get("step", 1) % inner_steps == 0:
            record = {**record, "outer_eval_loss": record["eval_loss"]}
        mesh.publish(record)
    return publish


def _restore_outer(trainer: Trainer, outer: OuterOptimizer, sync_period: int) -> int:
    """The outer step a resumed node's checkpoint holds (0 when it did not resume), its outer state loaded."""
    if trainer.restored is None:
        return 0
    saved = trainer.checkpoints.load_rank_tensors(trainer.restored)
    if saved is None or "diloco_state" not in saved:
        raise ValueError(f"{trainer.restored} holds no DiLoCo outer state (written by a one-node run?); resume a "
                         "multi-node node from a checkpoint its own multi-node run wrote")
    step = int(saved["diloco_outer_step"])
    if trainer.step != step * sync_period:
        raise ValueError(f"{trainer.restored} is at inner step {trainer.step}, not at the end of outer step {step}; "
                         "it cannot be resumed exactly")
    outer.load_state_tensor(saved["diloco_state"])
    return step


def shared_settings(config: JobConfig) -> dict:
    """Settings of the outer loop every node of a run must share (the coordinator names any difference)."""
    d, m = config.diloco, config.mesh
    return {"diloco.inner_steps": d.inner_steps, "diloco.mode": d.mode, "diloco.fragments": d.fragment_count,
            "diloco.overlap": d.overlap, "diloco.compression": d.compression,
            "diloco.outer_lr": d.outer_lr, "diloco.outer_momentum": d.outer_momentum,
            "mesh.streams_per_peer": m.streams_per_peer}


def attach_to_run(trainer: Trainer, config: JobConfig, token: str, name: str | None,
                  faults: OuterStepFaults | None = None) -> ElasticDeviceMesh:
    H = config.diloco.inner_steps
    if config.checkpoint.every % H:
        raise ValueError(f"checkpoint.every {config.checkpoint.every} is not a multiple of diloco.inner_steps {H}: a "
                         "multi-node node can only be resumed from the end of an outer step")
    if config.diloco.fragment_count > config.mesh.snapshot_keep:
        raise ValueError(f"diloco.fragments {config.diloco.fragment_count} is over mesh.snapshot_keep "
                         f"{config.mesh.snapshot_keep}: a node catching up replays up to fragments − 1 updates after "
                         "the newest whole snapshot; raise mesh.snapshot_keep")
    outer = OuterOptimizer(local_shards(trainer.model), config.diloco.outer_lr, config.diloco.outer_momentum,
                           config.diloco.fragment_count)
    restored_step = _restore_outer(trainer, outer, config.diloco.sync_period)
    # The run leases data shards to local ranks as work of kind "data" (elastic_mesh knows no shards).
    data = {"items": len(make_shards(trainer.train_files, config.data.parts_per_file)),
            "fingerprint": data_fingerprint(trainer.train_files, config.data.parts_per_file)}
    facts = {"name": name or socket.gethostname(), "fingerprint": config.model_fingerprint(),
             "state_hash": node_hash(outer.digest()), "address": "", "restored_round": restored_step,
             "work": {"data": data}, "protocol": shared_settings(config)}
    # Served to peers that are behind: whole snapshots and inner moments of the newest two outer steps,
    # and the averaged updates of the last mesh.snapshot_keep, which a node a few steps behind replays.
    serves = {"snapshot": 2, "update": config.mesh.snapshot_keep, "inner": 2}
    mesh = ElasticDeviceMesh(config.mesh, token, facts, serves)
    hook = DilocoHook(trainer.model, mesh, config.diloco, outer, trainer.run_dir / "downloads", faults)
    hook.outer_step = restored_step
    trainer.hooks.append(hook)
    trainer.checkpoint_tensors.append(hook.checkpoint_tensors)
    trainer.checkpoint_multiple = H
    trainer.metrics.sinks.append(_dashboard_sink(mesh, config.diloco.inner_steps))
    # Each local rank leases its own shards, mid-round if it runs out; see prime/data/leased.py.
    worker = dist.get_rank()
    trainer.lease_data(lambda held, spare: mesh.lease("data", worker, held, spare), worker)
    trainer.prefix = f"[{mesh.name}]"
    trainer.progress.prefix = trainer.prefix
    trainer.progress.sync_every = config.diloco.sync_period
    trainer.metrics.name_run(mesh.name, group=mesh.joined["run_id"])
    if dist.get_rank() == 0 and config.train.eval_every % config.diloco.inner_steps:
        log.warning("[%s] train.eval_every %d is not a multiple of diloco.inner_steps %d: eval loss will be measured "
                    "on inner weights between syncs, not on the outer model", mesh.name, config.train.eval_every,
                    config.diloco.inner_steps)
    if dist.get_rank() == 0:
        log.info("[%s] joined run %s at outer step %d (%d local rank(s), data shards leased from the coordinator)",
                 mesh.name, mesh.joined["run_id"], mesh.joined["committed_round"], dist.get_world_size())
    return mesh
