"""A policy version as a broadcast: the Hugging Face directory (safetensors weights, config, tokenizer,
TOPLOC thresholds) travels as files through `elastic_mesh.broadcast`, signed by the coordinator and
checked chunk by chunk, so a worker loads nothing that the trainer did not publish. Nothing is unpickled:
weights are safetensors, the rest JSON."""

from __future__ import annotations

import copy
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from transformers import PreTrainedModel

from elastic_mesh import BroadcastMember, BroadcastSettings, ChunkDir, payload
from prime.inference.hf_engine import load_hf_policy
from prime.verify.thresholds import FILENAME as THRESHOLDS_FILE
from prime.verify.thresholds import ToplocThresholds

POLICY_KIND = "policy"
# Written by save_pretrained for every version; everything else in the base directory (tokenizer files,
# toploc.json) is the same for every version and is copied from it.
_PER_VERSION = ("config.json", "generation_config.json")
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth")
_writing = threading.Lock()
SMALL_POLICY_BYTES = 64 << 20
POLICY_CHUNKS, MIN_POLICY_CHUNK = 64, 32 << 10


def policy_broadcast_settings(keep: int, advertise_host: str | None, port: int = 0,
                              payload_bytes: int | None = None) -> BroadcastSettings:
    """How trainer, orchestrator and workers share policy versions. A version comes every second or so
    and every step waits on it, so a small policy travels in small chunks: a relay passes a chunk on once
    it holds all of it, so a version's last chunk trails the others by about one chunk's time on a
    member's link. Up to a 64 MiB policy a version is cut into about POLICY_CHUNKS chunks (a power of two
    of at least 32 KiB: a 1.2 MB policy in 37), above it into the default chunk (a large policy needs no
    more requests per byte). The 1.2 MB policy to 3 members, 10 ms / 50 Mbit/s links (version_stream.py):
    128 KiB chunks 0.49-0.67 s, 64 KiB 0.41-0.50 s, 32 KiB 0.37-0.48 s, 16 KiB 0.40-0.43 s.
    payload_bytes: the policy's size, for the publisher (whose chunks everyone fetches)."""
    chunk = {"chunk_mb": policy_chunk_bytes(payload_bytes) / (1 << 20)} if payload_bytes is not None \
        and payload_bytes < SMALL_POLICY_BYTES else {}
    # A chunk that no member holds for 5 s belongs to a version every holder has retired (newer ones came):
    # waiting the default minute for it held a submission's verification, and with it the batch its
    # prompts were promised to, for that minute (async 4, 10 ms links: a version the orchestrator skipped).
    # Two downloads at once: a version announced while the last one's final chunks still arrive starts at
    # once (one at a time, a version waited behind the one before in a fifth of the cases, async 2).
    return BroadcastSettings(keep=keep, advertise_host=advertise_host, port=port, stall_s=5.0, follow_overlap=2,
                             **chunk)


def policy_chunk_bytes(payload_bytes: int) -> int:
    """The chunk of a small policy: the smallest power of two that cuts it into at most POLICY_CHUNKS,
    between 32 KiB and the broadcast's default chunk."""
    default = int(BroadcastSettings().chunk_mb * (1 << 20))
    chunk = MIN_POLICY_CHUNK
    while chunk < default and chunk * POLICY_CHUNKS < payload_bytes:
        chunk *= 2
    return chunk


def publish_policy(member: BroadcastMember, version: int, model, base_dir: Path, meta: dict,
                   weights: dict | None = None, dtype: torch.dtype = torch.float32) -> None:
    """Publishes `model` as `version`, with the tokenizer and thresholds of `base_dir`. weights: its full
    state dict where the model itself is sharded (FSDP2). dtype: what the floating-point weights travel
    in (a reader loads them into the dtype it computes in)."""
    if dtype != torch.float32:
        weights = {name: t.to(dtype) if t.is_floating_point() else t
                   for name, t in (model.state_dict() if weights is None else weights).items()}
    with tempfile.TemporaryDirectory(prefix="policy-") as tmp:
        out = Path(tmp)
        model.save_pretrained(out, state_dict=weights, safe_serialization=True)
        for file in Path(base_dir).iterdir():
            if file.is_file() and file.name not in _PER_VERSION and not file.name.endswith(_WEIGHTS):
                shutil.copy2(file, out / file.name)
        tensors, files_meta = payload.files_as_tensors([out])
        member.publish(version, tensors, {**meta, **files_meta})


def fetch_policy(member: BroadcastMember, manifest: dict, root: Path) -> Path:
    """Fetches the version `manifest` names (verified) and writes its directory under `root`."""
    target, _ = member.fetch(manifest=manifest)
    return write_policy(target, root)


def write_policy(target: ChunkDir, root: Path) -> Path:
    """A complete, verified version's directory under `root` (written once, atomically)."""
    out = Path(root) / f"v{target.version:08d}"
    with _writing:  # a follower thread and a fetch on demand may write the same version
        if not (out / "config.json").is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
            payload.write_files(target, staging)
            shutil.rmtree(out, ignore_errors=True)
            staging.rename(out)
    return out


@dataclass(frozen=True)
class LoadedPolicy:
    """A version in memory: its model (in the reader's compute dtype), its TOPLOC thresholds, the
    config.json it was built from (a later version with the same one can be loaded into a copy of it),
    and its directory where one was written."""

    model: PreTrainedModel
    thresholds: ToplocThresholds
    config: bytes
    directory: Path | None = None


def load_policy_version(target: ChunkDir, root: Path, dtype: torch.dtype, like: LoadedPolicy | None) -> LoadedPolicy:
    """A complete, verified version in memory. Where `like` (a version loaded before) has the same
    config, its model is copied and this version's weights go into the copy straight from the verified
    chunks: 3-7 ms for the digit policy against 15-28 ms to write the directory and load it with
    from_pretrained, paid by every worker and the orchestrator for every version, on the path every
    async step waits on. Otherwise (the first version, another config, weights in several files) the
    directory is written under `root` and loaded by from_pretrained. Nothing is unpickled either way."""
    files = payload.read_files(target)
    config, weights = bytes(files.get("config.json", b"")), files.get("model.safetensors")
    if like is not None and weights is not None and config == like.config and THRESHOLDS_FILE in files:
        model = copy.deepcopy(like.model)
        missing, unexpected = model.load_state_dict(safetensors.torch.load(bytes(weights)), strict=False)
        if not missing and not unexpected:  # else (tied weights left out, say): from_pretrained knows
            return LoadedPolicy(model.eval(), ToplocThresholds.model_validate_json(bytes(files[THRESHOLDS_FILE])), config)
    directory = write_policy(target, root)
    return LoadedPolicy(load_hf_policy(directory, dtype=dtype), ToplocThresholds.load(directory), config, directory)


def load_policy_directory(directory: Path, dtype: torch.dtype) -> LoadedPolicy:
    """A version written to disk (fetched on demand), loaded by from_pretrained."""
    return LoadedPolicy(load_hf_policy(directory, dtype=dtype), ToplocThresholds.load(directory),
                        (Path(directory) / "config.json").read_bytes(), Path(directory))


def prune_policies(root: Path, below: int) -> None:
    """Deletes the directories of versions older than `below` under `root` (their weights are in memory
    or no longer wanted): without it a worker kept every version it ever loaded on disk, a 1.2 MB policy
    215 times in one benchmark run, and a large policy would fill the disk within the hour."""
    with _writing:  # never a directory while write_policy writes it
        for path in Path(root).glob("v*"):
            number = path.name[1:9]  # v00000012, or its staging directory v00000012.<random>
            if number.isdigit() and int(number) < below:
                shutil.rmtree(path, ignore_errors=True)


def meta_of(manifest: dict) -> dict:
    return dict(manifest.get("meta") or {})
