"""How policy versions reach everyone who generates or verifies with them: the trainer publishes each
version (WeightPublisher), workers and the orchestrator follow them (WeightFollower). The broadcast
implements both: signed manifests, every chunk checked, every member relaying what it verified
(elastic_mesh's BroadcastMember; the HF directory as its payload: policy_files.py).

One follower serves both roles: a worker builds a generation engine from each version it holds, the
orchestrator a verifier (`build`); the rest (following announcements, loading each version into a copy
of the one before, waiting for a version on its way, fetching one the follower skipped, retiring old
ones) is the same.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, Protocol, TypeVar

import torch
from transformers import AutoTokenizer, PreTrainedModel

from elastic_mesh import BroadcastError, BroadcastMember
from prime.rl.transport.policy_files import (
    LoadedPolicy,
    fetch_policy,
    load_policy_directory,
    load_policy_version,
    prune_policies,
    publish_policy,
)

log = logging.getLogger(__name__)

Built = TypeVar("Built")
# What a follower keeps of each version's way here (wall clock, per version), for benchmarks; bounded.
TIMES_KEPT = 1000


class WeightPublisher(Protocol):
    """The trainer's side: publishes each version it trains."""

    def newest(self) -> int:
        """The newest version the run already holds (-1: none): a restarted trainer skips those."""

    def publish(self, version: int, model: PreTrainedModel, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Publishes `model` as `version`. weights: its full state dict where the model is sharded."""


class RetryingPublisher:
    """A WeightPublisher the trainer cannot die of: a publish refused or failed (the coordinator away, a
    refusal it may lift) is logged and retried in the background, at 1 s, doubling to `max_retry_s`,
    until it or a newer version goes out; the trainer trains on meanwhile. With async level >= 1 the
    batches go on from the versions already out; a newer version published supersedes the one that
    failed. The weights of a version waiting for its retry are copied at once: the model trains on."""

    def __init__(self, inner: WeightPublisher, first_retry_s: float = 1.0, max_retry_s: float = 30.0) -> None:
        self.inner, self.first_retry_s, self.max_retry_s = inner, first_retry_s, max_retry_s
        self.failures = 0  # publishes that failed at least once, for the trainer's log and tests
        self._pending: tuple[int, PreTrainedModel, dict[str, torch.Tensor]] | None = None
        self._publishing = threading.Lock()  # one publish at a time: versions only go up
        self._wake = threading.Event()
        self._retrier: threading.Thread | None = None

    def newest(self) -> int:
        return self.inner.newest()

    @property
    def waiting(self) -> int | None:
        """The version waiting for a retry, if any."""
        pending = self._pending
        return None if pending is None else pending[0]

    def publish(self, version: int, model: PreTrainedModel, weights: dict[str, torch.Tensor] | None = None) -> None:
        with self._publishing:
            self._pending = None  # this version supersedes one still waiting
            if self._try(version, model, weights):
                return
            self.failures += 1
            state = model.state_dict() if weights is None else weights
            self._pending = (version, model, {name: t.detach().clone() for name, t in state.items()})
        if self._retrier is None:
            self._retrier = threading.Thread(target=self._retry, daemon=True, name="publish-retry")
            self._retrier.start()
        self._wake.set()

    def _try(self, version: int, model: PreTrainedModel, weights: dict[str, torch.Tensor] | None) -> bool:
        try:
            self.inner.publish(version, model, weights)
            return True
        except (BroadcastError, OSError) as e:
            try:
                newest = self.inner.newest()
            except (BroadcastError, OSError):
                newest = -1
            if newest >= version:  # out already (the answer was what got lost, or a newer one went)
                log.warning("version %d: publish answered %s, but the run holds version %d: going on", version, e,
                            newest)
                return True
            log.warning("version %d not published (%s); retried in the background, training goes on", version, e)
            return False

    def _retry(self) -> None:
        delay = self.first_retry_s
        while True:
            self._wake.wait()
            self._wake.clear()
            time.sleep(delay)
            with self._publishing:
                pending = self._pending
                if pending is None:
                    delay = self.first_retry_s
                    continue
                if self._try(*pending):
                    log.info("version %d published on a retry", pending[0])
                    self._pending, delay = None, self.first_retry_s
                    continue
            delay = min(delay * 2, self.max_retry_s)
            self._wake.set()


@dataclass(frozen=True)
class HeldVersion(Generic[Built]):
    """A version in memory: its policy (model and TOPLOC thresholds) and what the follower built of it."""

    version: int
    policy: LoadedPolicy
    built: Built


class WeightFollower(Protocol[Built]):
    """Everyone else's side: the versions announced and held here."""

    newest: int  # the newest version held here (-1: none yet)
    announced: int  # the newest version the run announced (it may still be on its way here)

    def follow(self) -> None:
        """Blocks: holds every version as it is announced (skipping any it fell behind on)."""

    def get(self, version: int, wait_s: float = 60.0) -> HeldVersion[Built]:
        """`version`, waited for while it is on its way, fetched if the follower skipped it; KeyError
        when it cannot be had (retired, never published, no source left)."""


class BroadcastPublisher:
    """WeightPublisher over the broadcast: each version is the HF directory of the model with the
    tokenizer and thresholds of `base_dir`, and `meta` in its signed manifest."""

    def __init__(self, member: BroadcastMember, base_dir: Path, meta: dict, dtype: torch.dtype = torch.float32) -> None:
        self.member, self.base_dir, self.meta, self.dtype = member, Path(base_dir), dict(meta), dtype

    def newest(self) -> int:
        try:
            return int(self.member.manifest()["version"])
        except BroadcastError:  # nothing published yet
            return -1

    def publish(self, version: int, model: PreTrainedModel, weights: dict[str, torch.Tensor] | None = None) -> None:
        publish_policy(self.member, version, model, self.base_dir, self.meta, weights, self.dtype)


class PolicyFollower(Generic[Built]):
    """WeightFollower over the broadcast. Each version is loaded (in `dtype`) into a copy of the newest
    one held, straight from the verified chunks (policy_files.load_policy_version), and `build` makes
    what the role uses of it; the `keep` newest are held, older ones retired (their directories
    deleted). on_announced(version) / on_new(version) run when a version is announced / held."""

    def __init__(self, member: BroadcastMember, root: Path, dtype: torch.dtype, keep: int,
                 build: Callable[[LoadedPolicy], Built], grace_s: float = 0.3) -> None:
        """grace_s: how long get() waits for the follower to start on a version it has not heard of
        yet (whoever asks for it usually heard of it at about the same moment) before fetching it itself."""
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        self.member, self.root, self.dtype, self.keep, self.build = member, Path(root), dtype, keep, build
        self.grace_s = grace_s
        self.root.mkdir(parents=True, exist_ok=True)
        self.newest = -1
        self.announced = -1
        self.tokenizer = None  # the policy's, from the first version held (every version ships the same)
        self.on_new: Callable[[int], None] = lambda version: None
        self.on_announced: Callable[[int], None] = lambda version: None
        # version -> wall clock when it was announced here, fetched (verified), held (usable)
        self.announced_at: dict[int, float] = {}
        self.fetched_at: dict[int, float] = {}
        self.loaded_at: dict[int, float] = {}
        self._held: dict[int, HeldVersion[Built]] = {}
        self._template: LoadedPolicy | None = None  # the newest held: the next version is loaded into a copy
        self._coming: set[int] = set()  # announced versions the follower is downloading now
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._fetching = threading.Lock()  # one fetch on demand at a time: the same bytes twice halve both

    # ---- following ---------------------------------------------------------------------------------
    def follow(self) -> None:
        self.member.follow(on_version=self._fetched, on_announced=self._announce, on_failed=self._failed)

    def _announce(self, manifest: dict) -> None:
        version = int(manifest["version"])
        with self._changed:
            self._coming.add(version)
            self.announced = max(self.announced, version)
            _stamp(self.announced_at, version)
            self._changed.notify_all()
        self.on_announced(self.announced)

    def _fetched(self, target, report) -> None:
        started = time.monotonic()
        try:
            with self._lock:
                _stamp(self.fetched_at, target.version)
                known, like = target.version in self._held, self._template
            if not known:
                self._adopt(load_policy_version(target, self.root, self.dtype, like), target.version, started,
                            report.seconds)
        except (BroadcastError, OSError) as e:  # retired meanwhile (newer ones came): on to the next version
            log.warning("version %d not loaded: %s", target.version, e)
        finally:
            self._settled(target.version)

    def _failed(self, manifest: dict, error: BroadcastError) -> None:
        self._settled(int(manifest["version"]))

    def _settled(self, version: int) -> None:
        """The follower is done with `version` (held or not): whoever waits for it stops waiting."""
        with self._changed:
            self._coming.discard(version)
            self._changed.notify_all()

    def _adopt(self, loaded: LoadedPolicy, version: int, started: float, fetch_s: float | None) -> HeldVersion:
        built = self.build(loaded)
        tokenizer = None
        if self.tokenizer is None and loaded.directory is not None:
            tokenizer = AutoTokenizer.from_pretrained(loaded.directory)
        with self._changed:
            held = self._held.setdefault(version, HeldVersion(version, loaded, built))
            if self.tokenizer is None:
                self.tokenizer = tokenizer
            if version >= self.newest:
                self.newest, self._template = version, loaded
            self.announced = max(self.announced, version)
            for old in sorted(self._held)[:-self.keep]:
                del self._held[old]
            _stamp(self.loaded_at, version)
            oldest = min(self._held)
            self._changed.notify_all()
        prune_policies(self.root, oldest)
        log.info("policy version %d loaded in %.2f s%s", version, time.monotonic() - started,
                 f" (fetched in {fetch_s:.2f} s)" if fetch_s is not None else "")
        self.on_new(version)
        return held

    # ---- asking ------------------------------------------------------------------------------------
    def times(self) -> dict[str, dict[int, float]]:
        """When each recent version was announced here, fetched (verified) and held (usable): wall clock."""
        with self._lock:
            return {"announced_at": dict(self.announced_at), "fetched_at": dict(self.fetched_at),
                    "loaded_at": dict(self.loaded_at)}

    def held(self, version: int) -> HeldVersion[Built]:
        """`version` if it is held now (KeyError otherwise); never waits."""
        with self._lock:
            return self._held[version]

    def get(self, version: int, wait_s: float = 60.0) -> HeldVersion[Built]:
        now = time.monotonic()
        deadline, grace = now + wait_s, now + min(self.grace_s, wait_s)
        with self._changed:
            while version not in self._held and time.monotonic() < deadline and (
                    version in self._coming or self.newest < version <= self.announced
                    or (self.newest < version and time.monotonic() < grace)):
                self._changed.wait(max(0.0, min(0.05 if time.monotonic() < grace else 0.5,
                                                deadline - time.monotonic())))
            if version in self._held:
                return self._held[version]
            if version <= self.newest - self.keep:
                raise KeyError(version)  # retired: newer ones are held
        with self._fetching:
            try:
                with self._lock:
                    if version in self._held:  # fetched by someone else meanwhile
                        return self._held[version]
                started = time.monotonic()
                directory = fetch_policy(self.member, self.member.manifest(version), self.root)
                return self._adopt(load_policy_directory(directory, self.dtype), version, started,
                                   time.monotonic() - started)
            except (BroadcastError, OSError) as e:  # OSError: retired while it was written (newer ones came)
                log.warning("version %d could not be fetched: %s", version, e)
                raise KeyError(version) from None


def _stamp(times: dict[int, float], version: int) -> None:
    times[version] = time.time()
    if len(times) > TIMES_KEPT:
        del times[min(times)]
