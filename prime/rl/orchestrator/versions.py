"""The policy versions the orchestrator verifies against, and what it asks of them (VerifiedVersions).
They are followed through the broadcast (the same signed, chunk-checked path the workers use: one
PolicyFollower, building a TOPLOC verifier of each version), loaded in float32. A version counts as
soon as the coordinator announces it, so workers that hold it get work while this side still
downloads it; only the verification of its rollouts waits for it."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

import torch

from elastic_mesh import BroadcastMember
from prime.inference.hf_engine import eos_id_of
from prime.rl.transport.policy_files import LoadedPolicy
from prime.rl.transport.weights import PolicyFollower
from prime.verify.verifier import Verifier


class VerifiedVersions(Protocol):
    newest: int  # the newest version held here (its rollouts can be verified)
    announced: int  # the newest version announced (workers may be leased work on it)
    tokenizer: object | None  # the policy's tokenizer, once a version is held
    on_new: Callable[[int], None]  # set by the orchestrator: a version is held
    on_announced: Callable[[int], None]  # ... or announced

    def verifier(self, version: int) -> Verifier:
        """Waits for a version on its way here; KeyError when it cannot be had."""

    def model(self, version: int) -> torch.nn.Module:
        """A version held now (KeyError otherwise)."""

    def allowed_dtypes(self) -> list[str] | None:
        """The worker compute dtypes the newest held version was calibrated for (None: none held yet)."""

    def tokenize(self, text: str) -> list[int]: ...

    def decode(self, tokens: list[int]) -> str: ...


class FollowedVersions:
    """VerifiedVersions over the broadcast: the newest `keep` versions, each with its verifier."""

    def __init__(self, member: BroadcastMember, root: Path, keep: int, verify_batch_size: int) -> None:
        def build(policy: LoadedPolicy) -> Verifier:
            return Verifier(policy.model, policy.thresholds, eos_id_of(policy.model), verify_batch_size)
        self.follower = PolicyFollower(member, root, torch.float32, keep, build)
        self.on_new: Callable[[int], None] = lambda version: None
        self.on_announced: Callable[[int], None] = lambda version: None
        self.follower.on_new = lambda version: self.on_new(version)
        self.follower.on_announced = lambda version: self.on_announced(version)

    newest = property(lambda self: self.follower.newest)
    announced = property(lambda self: self.follower.announced)
    tokenizer = property(lambda self: self.follower.tokenizer)

    def follow(self) -> None:
        self.follower.follow()

    def verifier(self, version: int, wait_s: float = 60.0) -> Verifier:
        return self.follower.get(version, wait_s).built

    def model(self, version: int) -> torch.nn.Module:
        return self.follower.held(version).policy.model

    def allowed_dtypes(self) -> list[str] | None:
        newest = self.newest
        return list(self.follower.held(newest).policy.thresholds.limits) if newest >= 0 else None

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)
