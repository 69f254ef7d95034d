"""Makes a trainer one DiLoCo replica of a multi-node run: join with a token, attach the outer loop."""

from __future__ import annotations

import logging
import socket

import torch.distributed as dist

from elastic_mesh import ElasticDeviceMesh, MeshConfig, node_hash
from prime.data.shards import data_fingerprint, make_shards
from prime.diloco.config import DilocoConfig
from prime.diloco.error_feedback import ErrorFeedback
from prime.diloco.faults import OuterStepFaults
from prime.diloco.hook import build_outer_loop
from prime.diloco.outer_optimizer import OuterOptimizer, local_shards
from prime.pretrain.trainer import RunMembership, Trainer

log = logging.getLogger(__name__)


def _dashboard_sink(mesh: ElasticDeviceMesh, inner_steps: int, every: int):
    """What of the node's metrics goes to the run's dashboard (with its heartbeats): every outer-step,
    eval and checkpoint record, and an inner step's record every `every` steps (the progress line's
    cadence). Every step's record was ~0.2 kB per inner step on the wire: more than a sparse outer step
    sends per inner step at H=100 (launch/bench/comm_bytes.py); metrics.jsonl keeps them all."""
    def publish(record: dict) -> None:
        if "loss" in record and "outer_step" not in record and record.get("step", 0) % every:
            return
        # Right after an outer step the model is the outer model: its eval loss is the run's.
        if "eval_loss" in record and record.get("step", 1) % inner_steps == 0:
            record = {**record, "outer_eval_loss": record["eval_loss"]}
        mesh.publish(record)
    return publish


def _restore_outer(trainer: Trainer, outer: OuterOptimizer, feedback: ErrorFeedback | None, sync_period: int) -> int:
    """The outer step a resumed node's checkpoint holds (0 when it did not resume), its outer state (and
    the sparse compression's residual) loaded."""
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
    if feedback is not None:
        if "diloco_error_feedback" in saved:
            feedback.load_state_tensor(saved["diloco_error_feedback"])
        else:  # written by a run with dense compression: nothing was left unsent
            log.warning("%s holds no sparse residual (written with dense compression); it starts at zero",
                        trainer.restored)
    return step


def shared_settings(diloco: DilocoConfig, mesh: MeshConfig) -> dict:
    """Settings of the outer loop every node of a run must share (the coordinator names any difference)."""
    return {"diloco.inner_steps": diloco.inner_steps, "diloco.mode": diloco.mode,
            "diloco.fragments": diloco.fragment_count, "diloco.overlap": diloco.overlap,
            "diloco.compression": diloco.wire_format, "diloco.outer_lr": diloco.outer_lr,
            "diloco.error_decay": diloco.sparse.error_decay if diloco.compression == "sparse" else None,
            "diloco.outer_momentum": diloco.outer_momentum, "mesh.streams_per_peer": mesh.streams_per_peer}


def attach_to_run(trainer: Trainer, diloco: DilocoConfig, mesh_config: MeshConfig, token: str, name: str | None,
                  faults: OuterStepFaults | None = None) -> ElasticDeviceMesh:
    """Joins the run the token names and makes `trainer` one of its DiLoCo replicas (Trainer.join_run).
    Returns the node's mesh (the caller closes it)."""
    config, H = trainer.config, diloco.inner_steps
    if config.checkpoint.every % H:
        raise ValueError(f"checkpoint.every {config.checkpoint.every} is not a multiple of diloco.inner_steps {H}: a "
                         "multi-node node can only be resumed from the end of an outer step")
    if diloco.fragment_count > mesh_config.keep_rounds:
        raise ValueError(f"diloco.fragments {diloco.fragment_count} is over mesh.keep_rounds "
                         f"{mesh_config.keep_rounds}: a node catching up replays up to fragments − 1 updates after "
                         "the newest whole snapshot; raise mesh.keep_rounds")
    outer = OuterOptimizer(local_shards(trainer.model), diloco.outer_lr, diloco.outer_momentum,
                           diloco.fragment_count)
    feedback = ErrorFeedback(sum(outer.sizes), diloco.sparse.error_decay) if diloco.compression == "sparse" else None
    restored_step = _restore_outer(trainer, outer, feedback, diloco.sync_period)
    # The run leases data shards to local ranks as work of kind "data" (elastic_mesh knows no shards).
    data = {"items": len(make_shards(trainer.train_files, config.data.parts_per_file)),
            "fingerprint": data_fingerprint(trainer.train_files, config.data.parts_per_file)}
    facts = {"name": name or socket.gethostname(), "fingerprint": config.model_fingerprint(),
             "state_hash": node_hash(outer.digest()), "address": "", "restored_round": restored_step,
             "work": {"data": data}, "protocol": shared_settings(diloco, mesh_config)}
    # Served to peers that are behind: whole snapshots and inner moments of the newest two outer steps,
    # and the averaged updates of the last mesh.keep_rounds, which a node a few steps behind replays.
    serves = {"snapshot": 2, "update": mesh_config.keep_rounds, "inner": 2}
    mesh = ElasticDeviceMesh(mesh_config, token, facts, serves)
    hook = build_outer_loop(trainer.model, mesh, diloco, outer, trainer.run_dir / "downloads", faults, restored_step,
                            feedback)
    worker = dist.get_rank()
    # Each local rank leases its own shards, mid-round if it runs out; see prime/data/leased.py.
    trainer.join_run(RunMembership(
        name=mesh.name, run_id=mesh.joined["run_id"], hook=hook, checkpoint_tensors=hook.checkpoint_tensors,
        checkpoint_multiple=H, sync_every=diloco.sync_period,
        sink=_dashboard_sink(mesh, H, max(1, config.train.log_every)),
        lease=lambda held, spare: mesh.lease("data", worker, held, spare), worker=worker))
    if dist.get_rank() == 0 and config.train.eval_every % H:
        log.warning("[%s] train.eval_every %d is not a multiple of diloco.inner_steps %d: eval loss will be measured "
                    "on inner weights between syncs, not on the outer model", mesh.name, config.train.eval_every, H)
    if dist.get_rank() == 0:
        log.info("[%s] joined run %s at outer step %d (%d local rank(s), data shards leased from the coordinator)",
                 mesh.name, mesh.joined["run_id"], mesh.joined["committed_round"], dist.get_world_size())
    return mesh
