"""The policy versions the orchestrator verifies against: followed through the broadcast (the same
signed, chunk-checked path the workers use), loaded in float32, the newest `keep` held. A version
counts as soon as the coordinator announces it, so workers that hold it get work while this side
still downloads it; only the verification of its rollouts waits for it."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoTokenizer

from elastic_mesh.broadcast.member import BroadcastError, BroadcastMember
from prime.inference.hf_engine import eos_id_of
from prime.rl.policy_transport import (
    LoadedPolicy,
    fetch_policy,
    load_policy_directory,
    load_policy_version,
    prune_policies,
    write_policy,
)
from prime.verify.verifier import Verifier

log = logging.getLogger(__name__)


class PolicyVersions:
    def __init__(self, member: BroadcastMember, root: Path, keep: int, verify_batch_size: int) -> None:
        self.member, self.root, self.keep, self.verify_batch_size = member, Path(root), keep, verify_batch_size
        self.root.mkdir(parents=True, exist_ok=True)
        self.models: dict[int, object] = {}
        self.verifiers: dict[int, Verifier] = {}
        self.tokenizer = None
        self.template: LoadedPolicy | None = None  # the newest version loaded: the next one is loaded into a copy
        self.newest = -1  # the newest version loaded here (rollouts of it can be verified)
        # The newest version the coordinator announced (a signed manifest): workers may be leased work on
        # it while it is still on its way here; its rollouts wait for it in verifier().
        self.announced = -1
        self.loading: set[int] = set()  # announced versions the follower is downloading (two may overlap)
        self.on_new: Callable[[int], None] = lambda version: None
        self.on_announced: Callable[[int], None] = lambda version: None
        self._lock = threading.Lock()
        self._loaded = threading.Condition(self._lock)
        self._fetching = threading.Lock()

    def follow(self) -> None:
        """Blocks: loads every version as it is announced (skipping any it fell behind on)."""
        threading.current_thread().name = "policy-versions"
        self.member.follow(on_version=self._followed, on_announced=self._announce, on_failed=self._failed)

    def _followed(self, target, report) -> None:
        try:
            with self._lock:
                like = self.template
            self._adopt(target.version, lambda: load_policy_version(target, self.root, torch.float32, like),
                        lambda: write_policy(target, self.root), report.seconds)
        except OSError as e:  # retired or pruned meanwhile: newer versions overtook it
            log.warning("version %d not loaded: %s", target.version, e)
            self._not_loading(target.version)

    def _announce(self, manifest: dict) -> None:
        with self._lock:
            self.announced = max(self.announced, int(manifest["version"]))
            self.loading.add(int(manifest["version"]))
        self.on_announced(self.announced)

    def _failed(self, manifest: dict, error: BroadcastError) -> None:
        self._not_loading(int(manifest["version"]))

    def _not_loading(self, version: int) -> None:
        """The version will not arrive by the follower: a verification waiting for it stops waiting."""
        with self._lock:
            self.loading.discard(version)
            self._loaded.notify_all()

    def _adopt(self, version: int, load: Callable[[], LoadedPolicy], directory: Callable[[], Path],
               fetch_s: float) -> None:
        """load(): the version in memory; directory(): one written to disk (for the tokenizer, once)."""
        try:
            loaded = load()
            tokenizer_from = None if self.tokenizer is not None else (loaded.directory or directory())
        except BaseException:
            self._not_loading(version)
            raise
        with self._lock:
            self.loading.discard(version)  # with the verifier in place: a waiter sees one or the other
            if self.tokenizer is None:
                self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
            model = loaded.model
            self.models[version] = model
            self.verifiers[version] = Verifier(model, loaded.thresholds, eos_id_of(model), self.verify_batch_size)
            if version >= self.newest:
                self.template = loaded
            self.newest = max(self.newest, version)
            self.announced = max(self.announced, version)
            for old in [v for v in self.models if v <= self.newest - self.keep]:
                del self.models[old], self.verifiers[old]
            self._loaded.notify_all()
            oldest = min(self.models, default=version)
        prune_policies(self.root, oldest)
        log.info("policy version %d loaded (fetched in %.2f s)", version, fetch_s)
        self.on_new(version)

    def verifier(self, version: int, wait_s: float = 60.0) -> Verifier:
        """The verifier of `version`; waited for if it was announced and is on its way here (up to
        wait_s), fetched now if the follower skipped it. KeyError: no longer held, or never announced."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while version not in self.verifiers and time.monotonic() < deadline \
                    and (version in self.loading or self.newest < version <= self.announced):
                self._loaded.wait(max(0.0, min(1.0, deadline - time.monotonic())))
            if version in self.verifiers:
                return self.verifiers[version]
            if version <= self.newest - self.keep or version > self.newest:
                raise KeyError(version)
        with self._fetching:
            try:
                directory = fetch_policy(self.member, self.member.manifest(version), self.root)
                self._adopt(version, lambda: load_policy_directory(directory, torch.float32), lambda: directory, 0.0)
            except (BroadcastError, OSError) as e:  # OSError: pruned while loaded (newer ones came)
                log.warning("version %d could not be fetched for verification: %s", version, e)
                raise KeyError(version) from None
        with self._lock:
            return self.verifiers[version]

    def model(self, version: int):
        with self._lock:
            return self.models[version]

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)
