"""A policy version as a broadcast: the Hugging Face directory (safetensors weights, config, tokenizer,
TOPLOC thresholds) travels as files through `elastic_mesh.broadcast`, signed by the coordinator and
checked chunk by chunk, so a worker loads nothing that the trainer did not publish. Nothing is unpickled:
weights are safetensors, the rest JSON."""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path

import torch

from elastic_mesh.broadcast.member import BroadcastMember, BroadcastSettings
from elastic_mesh.broadcast.payload import files_as_tensors, write_files
from elastic_mesh.transfer.chunk_dir import ChunkDir

POLICY_KIND = "policy"
# Written by save_pretrained for every version; everything else in the base directory (tokenizer files,
# toploc.json) is the same for every version and is copied from it.
_PER_VERSION = ("config.json", "generation_config.json")
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth")
_writing = threading.Lock()
SMALL_POLICY_BYTES = 64 << 20


def policy_broadcast_settings(keep: int, advertise_host: str | None, port: int = 0,
                              payload_bytes: int | None = None) -> BroadcastSettings:
    """How trainer, orchestrator and workers share policy versions. A version comes every second or so
    and every step waits on it, so a small policy travels in small chunks (a relay passes a chunk on as
    soon as it holds it, and the publisher can hand each member a different one at once): 128 KiB up to
    a 64 MiB policy, the default chunk above it (a large policy needs no more requests per byte).
    payload_bytes: the policy's size, for the publisher (whose chunks everyone fetches). Measured in
    docs/benchmarks.md (RL section)."""
    small = payload_bytes is not None and payload_bytes < SMALL_POLICY_BYTES
    chunk = {"chunk_mb": 0.125} if small else {}
    # A chunk that no member holds for 5 s belongs to a version every holder has retired (newer ones came):
    # waiting the default minute for it held a submission's verification, and with it the batch its
    # prompts were promised to, for that minute (async 4, 10 ms links: a version the orchestrator skipped).
    return BroadcastSettings(keep=keep, advertise_host=advertise_host, port=port, stall_s=5.0, **chunk)


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
        tensors, files_meta = files_as_tensors([out])
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
            write_files(target, staging)
            shutil.rmtree(out, ignore_errors=True)
            staging.rename(out)
    return out


def meta_of(manifest: dict) -> dict:
    return dict(manifest.get("meta") or {})
