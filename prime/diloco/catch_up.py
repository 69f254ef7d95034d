"""How a DiLoCo node that is behind (it joined a running job, missed a step's deadline, was partitioned
away, or diverged) reaches the run's newest committed step from its peers' snapshot servers, with
nobody waiting for it: it replays the averaged updates of the steps it missed, or fetches a whole
snapshot when it holds nothing usable, and checks the result against the hashes the coordinator
committed. DilocoReplica (prime/diloco/replica.py) holds one and hands it what it needs."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from elastic_mesh import ElasticDeviceMesh, TransferError, decode_wire, node_hash
from prime.core.optim import bound_first_moment, load_adam_state
from prime.diloco.config import DilocoConfig
from prime.diloco.outer_optimizer import OuterOptimizer, local_shards
from prime.diloco.trainer_view import TrainerView

log = logging.getLogger(__name__)


class LeftBehind(RuntimeError):
    """No other node is in the run any more and none holds the state this node needs: it cannot catch up."""


class StateMismatch(RuntimeError):
    """The state a node rebuilt from its peers does not hash to what the coordinator committed."""


def whole_snapshot_step(committed: int, fragments: int) -> int:
    """The newest outer step whose whole snapshot peers serve. Streaming serves one per H inner steps
    (every F-th outer step; each of the first F), since building and hashing the whole state every
    H/F steps costs training; a joiner replays the few fragment updates after it."""
    return committed if committed < fragments else committed - committed % fragments


class CatchUp:
    """Catching up from peers, into the outer optimizer it is given. `outer_step` is the step whose
    state the outer optimizer holds: the caller sets it before run() and reads it after."""

    def __init__(self, model: torch.nn.Module, mesh: ElasticDeviceMesh, config: DilocoConfig, outer: OuterOptimizer,
                 work_dir: Path) -> None:
        self.model, self.mesh, self.config, self.outer, self.work_dir = model, mesh, config, outer, work_dir
        self.outer_step = 0
        self.moments_step: int | None = None  # the outer step whose peers' AdamW moments the last catch-up took
        self._download_s = 0.0  # time spent fetching whole snapshots in the current catch-up

    def run(self, trainer: TrainerView, full: bool) -> dict:
        """Brings this node to the newest committed step from its peers, with nobody waiting for it: replays
        the updates it missed (or fetches a whole snapshot when it holds nothing usable), then waits for
        the next commit, replays that too, and starts the following round with everyone. The caller
        has stopped publishing (nothing else touches the outer optimizer meanwhile)."""
        started = time.perf_counter()
        # Its data is made ready beside the catch-up: the first step after a restart leases and opens
        # its shards (data.interleave of them: 0.7-1 s on a busy 2-core machine), and every other node
        # would wait for that step at the barrier of the round this node joins.
        with ThreadPoolExecutor(1, thread_name_prefix="prepare-data") as background:
            preparing = background.submit(trainer.prepare_data)
            try:
                record = self._catch_up(trainer, full, started)
            except BaseException:
                preparing.exception()  # waited for; the catch-up's own error is the one to report
                raise
            preparing.result()  # raises what preparing the data raised
        return record

    def _catch_up(self, trainer: TrainerView, full: bool, started: float) -> dict:
        fetched, replayed = self._bring_to_newest(full)
        # A node that had to take a whole snapshot holds no inner state worth keeping: it takes a peer's
        # moments of the same step, while the round in flight still runs.
        self.moments_step = None
        inner_bytes = self._take_inner_state(trainer) if fetched and self.config.take_peer_moments else 0
        if self.outer_step * self.config.sync_period < trainer.config.train.max_steps:
            # Back for the step after the one in flight: its barrier waits for this node's replay of
            # the one in flight, whose successor the overlapped modes launch moments after it commits.
            for _ in range(3):
                if self.mesh.rounds.will_join(self.outer_step + 2):
                    break
                more_fetched, more_replayed = self._bring_to_newest(full=False)  # the run moved on meanwhile
                fetched, replayed = fetched + more_fetched, replayed + more_replayed
            if self.mesh.rounds.wait_commit(self.outer_step)["alone"]:
                log.warning("%s: every other node has left the run; going on as its only member", self.mesh.name)
            more_fetched, more_replayed = self._bring_to_newest(full=False)
            fetched, replayed = fetched + more_fetched, replayed + more_replayed
        self.outer.copy_to(local_shards(self.model))
        trainer.jump_to_step(self.outer_step * self.config.sync_period)
        model_hash = node_hash(self.outer.digest())
        self.mesh.rounds.commit(self.outer_step, model_hash)  # the coordinator now waits for this node again
        elapsed = time.perf_counter() - started
        download_s, self._download_s = self._download_s, 0.0
        trainer.progress.note(f"caught up to outer step {self.outer_step} in {elapsed:.1f} s: "
                              f"{fetched / 1e6:.1f} MB of snapshot, {inner_bytes / 1e6:.1f} MB of a peer's AdamW "
                              f"moments, {replayed} update(s) replayed, hash {model_hash}")
        return {"caught_up_to": self.outer_step, "snapshot_bytes": fetched, "inner_state_bytes": inner_bytes,
                "moments_step": self.moments_step,
                "replayed": replayed,
                "catch_up_s": round(elapsed, 3), "download_s": round(download_s, 3), "model_hash": model_hash,
                "step": trainer.step}

    def _take_inner_state(self, trainer: TrainerView) -> int:
        """Peers' AdamW moments matching the state this node now holds: those published with the newest
        whole snapshot at or before its outer step (it may have replayed updates past the snapshot it
        fetched, and peers keep the moments of their last two whole snapshots only). A publisher may still
        be writing them: a few tries; then the newest moments any peer holds, a step or two off. Without
        any the node goes on with fresh moments, which costs loss, never correctness; the log says why."""
        work_dir = self.work_dir / f"rank{self.mesh.local_rank}"
        matching = whole_snapshot_step(self.outer_step, self.config.fragment_count)
        error: Exception | None = None
        for attempt in range(5):
            sources = self.mesh.rounds.sources()
            wanted = matching if attempt < 3 else None  # None: the newest any source holds

            def fetch_and_load() -> int:
                # Moments differ between peers; any peer's are a fair estimate, so each chunk may come
                # from a different one (mixed) and the download uses every source's uplink.
                _, tensors, report = self.mesh.fetch(sources, "inner", wanted, work_dir, mixed=True)
                betas = trainer.optimizer.param_groups[0].get("betas")  # none: SGD, which keeps no moments
                bounded = bound_first_moment(tensors, betas) if betas else 0
                if bounded:
                    log.info("%s: %d of %d first moments bounded (taken from another peer than their second "
                             "moments)", self.mesh.name, bounded, tensors["exp_avg"].numel())
                load_adam_state(trainer.optimizer, list(self.model.parameters()), tensors)
                self.moments_step = report.version
                return report.total_bytes
            try:
                taken = self._agreed(fetch_and_load)  # every local rank loads its shard's moments, or none does
            except TransferError as e:
                error = e
                time.sleep(0.5 * (attempt + 1))
                continue
            if self.moments_step != matching:
                log.warning("%s: no peer holds the AdamW moments of outer step %d any more; took those of step "
                            "%d for the state of step %d", self.mesh.name, matching, self.moments_step,
                            self.outer_step)
            return taken
        log.warning("%s: no peer's AdamW moments for outer step %d (%s); going on with fresh ones", self.mesh.name,
                    matching, str(error)[:200])
        self.moments_step = None
        return 0

    def _bring_to_newest(self, full: bool) -> tuple[int, int]:
        """Returns (snapshot bytes fetched, updates replayed). Keeps trying for diloco.catch_up_timeout_s:
        a source may be restarting, partitioned, or still publishing the newest step."""
        fetched, attempt = 0, 0
        give_up = time.monotonic() + self.config.catch_up_timeout_s
        while True:
            attempt += 1
            sources = self.mesh.rounds.sources()
            if sources["alone"]:  # nobody else is live: nothing to fetch, nobody to wait for
                if not full and sources["committed_round"] == self.outer_step:
                    return fetched, 0  # it holds the newest state: it goes on as the run's only member
                raise LeftBehind(
                    f"{self.mesh.name} cannot catch up: no other node is in the run any more (they finished and "
                    f"left, or died) and it holds outer step {self.outer_step} of the {sources['committed_round']} "
                    "committed; resume the run from the nodes' checkpoints (--resume) to go on")
            try:
                if full or sources["committed_round"] - self.outer_step > self.mesh.config.keep_rounds:
                    fetched += self._load_snapshot(sources)
                    full = False
                return fetched, self._replay(sources)
            except (StateMismatch, TransferError) as e:
                # A wrong state, or updates that stay unavailable (the newest one is usually only moments
                # from being published; peers resumed from checkpoints keep none): a whole snapshot next.
                full = full or isinstance(e, StateMismatch) or attempt >= 3
                if time.monotonic() > give_up:
                    raise TransferError(f"{self.mesh.name} could not catch up with the run for "
                                        f"{self.config.catch_up_timeout_s:.0f} s: {e}") from None
                log.warning("%s: catching up failed (attempt %d): %s", self.mesh.name, attempt, str(e)[:300])
                # Soon at first: the newest update is usually published a moment after the step commits.
                time.sleep(min(0.25 * 4 ** (attempt - 1), 5.0))

    def _agreed(self, fetch):
        """Runs fetch() on every local rank; all or none succeed (so the collectives that follow stay aligned)."""
        result, error = None, None
        try:
            result = fetch()
        except (TransferError, OSError, ValueError, KeyError) as e:  # one rank must never fail alone
            error = e if isinstance(e, TransferError) else TransferError(f"{type(e).__name__}: {e}")
        if not self.mesh.agree(error is None):
            raise error or TransferError("another local rank could not fetch its shard")
        return result

    def _load_snapshot(self, sources: dict) -> int:
        step = whole_snapshot_step(sources["committed_round"], self.config.fragment_count)
        manifest, tensors, report = self._agreed(
            lambda: self.mesh.fetch(sources, "snapshot", step, self.work_dir / f"rank{self.mesh.local_rank}"))
        self.outer.load_state_tensor(tensors["state"])
        self.outer_step = step
        self._download_s += report.seconds
        self._check_hash(step, sources)
        log.info("%s: snapshot of outer step %d fetched: %.1f MB in %.1f s from %s", self.mesh.name, step,
                 report.total_bytes / 1e6, report.seconds, ", ".join(report.bytes_from))
        return report.total_bytes

    def _replay(self, sources: dict) -> int:
        target = sources["committed_round"]
        start = self.outer_step
        for step in range(start + 1, target + 1):
            mean, meta = self._agreed(lambda: self._fetch_update(sources, step))
            self.outer.apply(mean, meta.get("fragment"))  # the model gets the result once caught up
            self.outer_step = step
        self._check_hash(target, sources)
        return target - start

    def _fetch_update(self, sources: dict, step: int) -> tuple[torch.Tensor, dict]:
        """The mean of outer step `step` and its meta, decoded from its wire bytes (bytes that do not decode
        are a failed transfer: ValueError, which _agreed turns into one; the hash check catches the rest)."""
        manifest, tensors, _ = self.mesh.fetch(sources, "update", step, self.work_dir / f"rank{self.mesh.local_rank}")
        meta = manifest["meta"]
        if "mean" in tensors:
            return tensors["mean"], meta
        try:
            return decode_wire(tensors["wire"], meta["codec"], meta["layout"]), meta
        except (TypeError, RuntimeError, IndexError) as e:  # a layout that does not fit the bytes
            raise ValueError(f"update {step} does not decode: {e}") from e

    def _check_hash(self, step: int, sources: dict) -> None:
        expected = sources["hashes"].get(step)
        for _ in range(40):  # the members commit their hashes moments after the step is applied
            if expected is not None:
                break
            time.sleep(0.25)
            expected = self.mesh.rounds.sources()["hashes"].get(step)
        got = node_hash(self.outer.digest())
        if got != expected:
            raise StateMismatch(f"outer step {step} rebuilt from peers hashes to {got}, the run committed {expected}")
