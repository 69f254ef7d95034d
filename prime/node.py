"""Makes a trainer one DiLoCo replica of a multi-node run: join with a token, attach the outer loop."""

from __future__ import annotations

import logging
import socket

import torch.distributed as dist

from elastic_mesh.mesh import ElasticDeviceMesh, node_hash
from prime.config import JobConfig
from prime.diloco import DilocoHook, OuterOptimizer, local_shards
from prime.trainer import Trainer

log = logging.getLogger(__name__)


def _dashboard_sink(mesh: ElasticDeviceMesh, inner_steps: int):
    def publish(record: dict) -> None:
        # Right after an outer step the model is the outer model: its eval loss is the run's.
        if "eval_loss" in record and record.get("step", 1) % inner_steps == 0:
            record = {**record, "outer_eval_loss": record["eval_loss"]}
        mesh.publish(record)
    return publish


def attach_to_run(trainer: Trainer, config: JobConfig, token: str, name: str | None) -> ElasticDeviceMesh:
    outer = OuterOptimizer(local_shards(trainer.model), config.diloco.outer_lr, config.diloco.outer_momentum)
    facts = {"name": name or socket.gethostname(), "fingerprint": config.model_fingerprint(),
             "model_hash": node_hash(outer.digest()), "address": ""}
    mesh = ElasticDeviceMesh(config.mesh, token, facts)
    trainer.hooks.append(DilocoHook(trainer.model, mesh, config.diloco, outer, trainer.run_dir / "downloads",
                                    config.chaos))
    trainer.metrics.sinks.append(_dashboard_sink(mesh, config.diloco.inner_steps))
    slots, local_world = config.diloco.data_slots, dist.get_world_size()
    slot = mesh.joined["node_index"] % slots
    if mesh.joined["node_index"] >= slots:
        log.warning("%s shares data slot %d with an earlier node (diloco.data_slots = %d)", mesh.name, slot, slots)
    trainer.set_data_worker(slot * local_world + dist.get_rank(), slots * local_world)
    trainer.prefix = f"[{mesh.name}]"
    trainer.progress.prefix = trainer.prefix
    trainer.progress.sync_every = config.diloco.inner_steps
    trainer.metrics.name_run(mesh.name, group=mesh.joined["run_id"])
    if dist.get_rank() == 0 and config.train.eval_every % config.diloco.inner_steps:
        log.warning("[%s] train.eval_every %d is not a multiple of diloco.inner_steps %d: eval loss will be measured "
                    "on inner weights between syncs, not on the outer model", mesh.name, config.train.eval_every,
                    config.diloco.inner_steps)
    if dist.get_rank() == 0:
        log.info("[%s] joined run %s at outer step %d (data slot %d of %d, %d local rank(s))", mesh.name,
                 mesh.joined["run_id"], mesh.joined["committed_step"], slot, slots, local_world)
    return mesh
