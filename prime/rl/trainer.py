"""The RL trainer (trusted): takes GRPO batches from the orchestrator, steps the policy, checkpoints,
and publishes each new version through the broadcast.

    python -m prime.rl.trainer --token-file trainer.token --policy DIR --orchestrator HOST:PORT --run-dir D

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

import argparse
import copy
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)

from elastic_mesh.broadcast.member import (
    BroadcastError,
    BroadcastMember,
)
from elastic_mesh.control.client import CoordinatorClient, CoordinatorError
from prime.core.checkpoint import CheckpointStore
from prime.core.cli import setup_logging
from prime.core.distributed import broadcast_json, close_local_group, init_local_group
from prime.core.optim import OptimConfig, build_optimizer
from prime.core.parallelize import parallelize
from prime.inference.hf_engine import load_hf_policy
from prime.rl.cli import load_config, read_token_argument
from prime.rl.grpo import ENTROPY_BONUS, GRPOConfig
from prime.rl.policy_transport import (
    POLICY_KIND,
    policy_broadcast_settings,
    publish_policy,
)
from prime.rl.update import Row, sharded_update
from prime.verify.thresholds import ToplocThresholds

log = logging.getLogger("prime.rl.trainer")


class RLTrainerConfig(BaseModel):
    """How the trainer steps the policy on each batch, and how long it trains."""

    model_config = ConfigDict(extra="forbid")

    max_steps: int = Field(600, gt=0, description="Steps after which the trainer ends the run (the orchestrator "
                           "may end it sooner: stop_at_reward).")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(
        lr=3e-4, betas=(0.9, 0.999), weight_decay=0.0, warmup_steps=0, schedule="constant"),
        description="AdamW; constant 3e-4 by default (1e-3 collapsed the digit policy's entropy early).")
    epochs: int = Field(2, ge=1, le=16, description="Optimizer steps per batch (ratio clipping acts from the second).")
    max_grad_norm: float = Field(1.0, gt=0)
    grpo: GRPOConfig = Field(default_factory=lambda: GRPOConfig(entropy_coef=ENTROPY_BONUS),
                             description="Clipping (epsilon, delta), the KL weight, the entropy bonus.")
    checkpoint_every: int = Field(5, ge=1, le=63, description="Steps between checkpoints (and after the last). A "
                                  "restarted trainer trains again at most this many steps minus one, on the same "
                                  "batches (the orchestrator keeps them). A checkpoint at every step cost the async-2 "
                                  "trainer 0.1 s of its 0.5 s step on 2 cores (docs/benchmarks.md, RL).")
    checkpoint_keep: int = Field(2, ge=1, description="Checkpoints kept in RUN_DIR/checkpoints.")
    publish_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="The precision each policy version travels in. float32: versions bit-identical to "
        "the trainer's weights. bfloat16 halves the bytes every version moves to every worker; workers and the "
        "verifier compute in float32 on the rounded weights while the trainer keeps float32. Measured on the "
        "digit policy (docs/benchmarks.md, RL): over the emulated WAN async-2 trainer idle 48% -> 31%, but "
        "1.2-1.6x as many versions to reach held-out 0.9, so no sooner there.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prime.rl.trainer", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--token", help="a run token with the publish right (token create --role worker --publish)")
    parser.add_argument("--token-file", type=Path, help="read the token from this file instead")
    parser.add_argument("--policy", type=Path, required=True, help="the HF directory to start from (with toploc.json)")
    parser.add_argument("--orchestrator", required=True, help="host:port of the orchestrator")
    parser.add_argument("--run-dir", type=Path, required=True, help="checkpoints and metrics.jsonl go here")
    parser.add_argument("--advertise-host", default=None, help="host workers reach this trainer's chunk server at")
    parser.add_argument("--config", type=Path, help="a TOML file of RLTrainerConfig fields")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a config field")
    args = parser.parse_args(argv)
    setup_logging("[trainer] ")
    config = load_config(RLTrainerConfig, args.config, args.set)
    token = read_token_argument(args.token, args.token_file)
    ToplocThresholds.load(args.policy)  # workers cannot be verified without it: fail here, not in the orchestrator
    group = init_local_group("cpu")
    rank, world = group.rank, group.world_size
    if rank != 0:  # one voice per trainer: the other local ranks only speak up about trouble
        logging.getLogger().setLevel(logging.WARNING)
    torch.manual_seed(0)
    model = load_hf_policy(args.policy)
    policy_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # what each version carries
    reference = copy.deepcopy(model).eval() if config.grpo.kl_coef > 0 else None
    model = parallelize(model, group.device, world, torch.float32, activation_checkpointing=False)
    optimizer, scheduler = build_optimizer(model, config.optim, config.max_steps)
    store = CheckpointStore(args.run_dir / "checkpoints", keep=config.checkpoint_keep, rank=rank, world_size=world)
    step = 0
    latest = store.latest()
    if latest is not None:
        state, _ = store.load(latest, model, optimizer)
        step = int(state["step"])
        scheduler.last_epoch = step
        log.info("resumed from %s: step %d", latest.name, step)
    member, orchestrator = None, None
    if rank == 0:  # the other local ranks only compute: the batch reaches them over the local group
        try:
            member = BroadcastMember(token, POLICY_KIND, args.run_dir / "broadcast",
                                     policy_broadcast_settings(keep=3, advertise_host=args.advertise_host,
                                                               payload_bytes=policy_bytes))
        except BroadcastError as e:
            raise SystemExit(f"cannot join the run: {e}") from None
        if not member.may_publish:
            raise SystemExit("this token has no publish right: the trainer publishes the policy "
                             "(token create --publish)")
        orchestrator = CoordinatorClient(args.orchestrator, request_timeout_s=60, retry_s=120, bearer=token,
                                         tls=member.client.tls_context())
    meta = {"orchestrator": args.orchestrator}
    # The coordinator is asked for its newest version once, at the start (a restarted trainer may find its
    # next version there already); after that this trainer is the only publisher and knows it.
    publish_dtype = getattr(torch, config.publish_dtype)
    published = _publish_if_missing(member, step, model, args.policy, meta, rank, world, publish_dtype)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        dropped = _drop_records_after(args.run_dir / "metrics.jsonl", step)
        if dropped:
            log.info("%d step records after step %d left metrics.jsonl: those steps are trained again", dropped, step)
    metrics = (args.run_dir / "metrics.jsonl").open("a") if rank == 0 else None
    started, idle_s, pad_id = time.monotonic(), 0.0, int(model.config.pad_token_id or 0)
    batches = BatchPrefetcher(orchestrator, keep=config.checkpoint_every + 1) if rank == 0 else None
    saved = step
    try:
        while step < config.max_steps:
            waited = time.monotonic()
            batch = broadcast_json(batches.get(step, prefetch=step + 1 < config.max_steps) if rank == 0 else None,
                                   rank, world)
            idle_s += time.monotonic() - waited
            if batch is None:
                log.info("the orchestrator ended the run at step %d", step)
                if saved != step:  # the policy the run ended with, for export
                    store.save(step, model, optimizer, {"step": step}, {})
                    saved = step
                break
            began = time.monotonic()
            rows = [Row(r["prompt"], r["tokens"], r["logprobs"], float(r["advantage"])) for r in batch["rows"]]
            stats = sharded_update(model, optimizer, rows, config.grpo, float(batch["temperature"]), pad_id, rank,
                                   world, config.epochs, config.max_grad_norm, reference)
            scheduler.step()
            step += 1
            trained = time.monotonic()
            # Published before any checkpoint is taken: every worker waits for the new version, nobody for
            # the checkpoint. A trainer killed before its next checkpoint resumes from the last one, trains
            # the steps since again on the same batches (the orchestrator keeps them) and finds their
            # versions already published.
            published = _publish_if_missing(member, step, model, args.policy, meta, rank, world, publish_dtype,
                                            published)
            published_at = time.time()
            publishing_done = time.monotonic()
            if step % config.checkpoint_every == 0 or step == config.max_steps:
                store.save(step, model, optimizer, {"step": step}, {})
                saved = step
            if rank != 0:
                continue
            elapsed = time.monotonic() - started
            record = {"step": step, "time_s": round(elapsed, 3), "train_s": round(time.monotonic() - began, 4),
                      "update_s": round(trained - began, 4), "publish_s": round(publishing_done - trained, 4),
                      "save_s": round(time.monotonic() - publishing_done, 4), "published_at": round(published_at, 3),
                      "idle_fraction": round(idle_s / max(elapsed, 1e-9), 4),
                      **{k: v for k, v in batch["stats"].items() if k != "prompt_numbers"}, **stats}
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            if step % 10 == 0 or step == config.max_steps:
                log.info("step %d/%d: batch reward %.3f, %d rows, staleness %.1f (max %d), idle %.0f%%", step,
                         config.max_steps, batch["stats"]["reward_mean"], len(rows), batch["stats"]["staleness_mean"],
                         batch["stats"]["staleness_max"], 100 * record["idle_fraction"])
        if rank == 0:
            orchestrator.post("/v1/rl/finish", {"version": step})
    except CoordinatorError as e:
        raise SystemExit(f"the orchestrator refused the trainer: {e}") from None
    finally:
        if batches is not None:
            batches.close()
        store.wait()
        if member is not None:
            member.stop()
        close_local_group()
    log.info("trainer done: %d steps, idle %.0f%% of %.0f s", step, 100 * idle_s / max(time.monotonic() - started, 1e-9),
             time.monotonic() - started)
    return 0


class BatchPrefetcher:
    """Asks the orchestrator for the next step's batch while this one trains: the request and the batch's
    way back (a round trip and the rows over the WAN, 0.11 s a step measured beyond the orchestrator's own
    wait) then overlap training instead of following it. Each request tells the orchestrator to keep the
    last `keep` batches (the checkpoint interval + 1), so a trainer restarted from its last checkpoint
    still finds every batch it asks for."""

    def __init__(self, orchestrator: CoordinatorClient, keep: int) -> None:
        self.orchestrator, self.keep = orchestrator, keep
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="next-batch")
        self._ahead: tuple[int, Future] | None = None

    def get(self, step: int, prefetch: bool = True) -> dict | None:
        """The batch of `step` (None: the run is over), then asks for step + 1 in the background."""
        if self._ahead is not None and self._ahead[0] == step:
            pending = self._ahead[1]
        else:
            pending = self._pool.submit(_next_batch, self.orchestrator, step, self.keep)
        self._ahead = None
        batch = pending.result()
        if batch is not None and prefetch:
            self._ahead = (step + 1, self._pool.submit(_next_batch, self.orchestrator, step + 1, self.keep))
        return batch

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _next_batch(orchestrator: CoordinatorClient, step: int, keep: int) -> dict | None:
    while True:
        answer = orchestrator.post("/v1/rl/batch", {"step": step, "keep": keep})
        if answer.get("status") == "ok":
            return answer
        if answer.get("status") == "done":
            return None


def _drop_records_after(path: Path, step: int) -> int:
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


def _publish_if_missing(member: BroadcastMember | None, version: int, model, base: Path, meta: dict, rank: int,
                        world: int, dtype: torch.dtype, known: int | None = None) -> int:
    """Publishes `version` unless the coordinator already has it (a restarted trainer); returns the newest
    version published. known: that newest version as this trainer last left it (None: ask the coordinator).
    Every local rank calls it: the full weights are gathered from the shards (a collective), local rank 0
    publishes."""
    newest = known
    if newest is None:
        newest = -1
        if rank == 0:
            try:
                newest = int(member.manifest()["version"])
            except BroadcastError:
                newest = -1
        newest = broadcast_json(newest, rank, world)
    if newest >= version:
        if rank == 0:
            log.info("version %d is already published (newest %d)", version, newest)
        return newest
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        publish_policy(member, version, model, base, meta, weights, dtype)
    return version


if __name__ == "__main__":
    raise SystemExit(main())
