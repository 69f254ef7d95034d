"""A policy version as published: the files a worker gets back load into the model the trainer meant,
in float32 bit for bit, or in bfloat16 as the trainer's weights rounded (publish_dtype)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from elastic_mesh.broadcast.payload import FILES_META
from elastic_mesh.transfer.chunk_dir import ChunkDir
from elastic_mesh.transfer.chunks import lay_out
from prime.inference.hf_engine import load_hf_policy
from prime.rl.policy import new_digit_policy
from prime.rl.transport.policy_files import load_policy_version, publish_policy
from prime.verify.proof import ProofSettings
from prime.verify.thresholds import Calibration, Limits, ToplocThresholds


class CapturingMember:
    """Stands in for the broadcast (tests/unit/test_broadcast.py covers its transport): keeps what is published."""

    def __init__(self) -> None:
        self.published: dict[int, tuple[dict[str, torch.Tensor], dict]] = {}

    def publish(self, version: int, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self.published[version] = (tensors, meta)


def _received(member: CapturingMember, version: int, out: Path) -> Path:
    tensors, meta = member.published[version]
    for name in meta[FILES_META]:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(tensors[name].numpy().tobytes())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_published_version_loads_as_the_trainers_weights_in_the_dtype_it_travelled_in(tmp_path, dtype):
    base = new_digit_policy(tmp_path / "base", seed=0)
    model = load_hf_policy(base)
    with torch.no_grad():  # a trained version: weights that are not round numbers in any precision
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    member = CapturingMember()
    publish_policy(member, 3, model, base, {"orchestrator": "10.0.0.1:1"}, dtype=dtype)
    weights_file = sum(t.numel() for n, t in member.published[3][0].items() if n.endswith(".safetensors"))
    parameters = sum(p.numel() for p in model.parameters())
    assert weights_file < parameters * (torch.finfo(dtype).bits // 8) + (64 << 10)  # the bytes travel in dtype
    received = load_hf_policy(_received(member, 3, tmp_path / "got"))  # what a worker computes with: float32
    for (name, sent), got in zip(model.state_dict().items(), received.state_dict().values()):
        assert got.dtype == torch.float32
        assert torch.equal(got, sent.to(dtype).float()), name
    if dtype == torch.bfloat16:
        assert any(not torch.equal(got, sent) for sent, got in zip(model.state_dict().values(),
                                                                     received.state_dict().values()))


def _as_chunk_dir(member: CapturingMember, version: int, out: Path) -> ChunkDir:
    """The version as a member holds it once every chunk is fetched and verified."""
    tensors, meta = member.published[version]
    chunked = lay_out(version, tensors, meta, chunk_bytes=32 << 10)
    target = ChunkDir(out, chunked.manifest)
    for index in range(target.chunks):
        assert target.put(index, bytes(chunked.chunk(index)))
    return target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_version_loads_from_its_chunks_into_a_copy_of_the_last_as_from_pretrained_would(tmp_path, dtype):
    """Workers and the orchestrator load each version into a copy of the one before, straight from the
    verified chunks; the weights are those from_pretrained gives, bit for bit. The first version, and one
    whose config differs, go through the directory and from_pretrained."""
    base = new_digit_policy(tmp_path / "base", seed=0)
    limits = Limits(exponent_mismatches=1, mantissa_mean=0.1, rollout_mantissa_mean=0.1, logit_noise=1e-5,
                    logprob_noise=1e-5)
    ToplocThresholds(proof=ProofSettings(), limits={"float32": limits}, calibration=Calibration(
        date="2026-12-06", torch=torch.__version__, device="cpu", chunks=1, tokens=1, conditions=[], margin=2,
        honest_maxima={})).save(base)  # written as calibration would: this test reads it back, nothing more
    model = load_hf_policy(base)
    member = CapturingMember()
    for version in (3, 4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 1e-3)
        publish_policy(member, version, model, base, {"orchestrator": "10.0.0.1:1"}, dtype=dtype)
    first = load_policy_version(_as_chunk_dir(member, 3, tmp_path / "c3"), tmp_path / "policies", torch.float32, None)
    assert first.directory == tmp_path / "policies" / "v00000003"  # the first: written and from_pretrained
    second = load_policy_version(_as_chunk_dir(member, 4, tmp_path / "c4"), tmp_path / "policies", torch.float32, first)
    assert second.directory is None and second.model is not first.model
    reference = load_hf_policy(_received(member, 4, tmp_path / "got"))
    for (name, got), want in zip(second.model.state_dict().items(), reference.state_dict().values()):
        assert got.dtype == torch.float32 and torch.equal(got, want), name
    assert not torch.equal(first.model.lm_head.weight, second.model.lm_head.weight)  # the copy, not the template
    assert second.thresholds == ToplocThresholds.load(tmp_path / "got")
    other = replace(first, config=first.config.replace(b'"num_hidden_layers"', b'"num_hidden_layers" '))
    again = load_policy_version(_as_chunk_dir(member, 4, tmp_path / "c4b"), tmp_path / "policies2", torch.float32, other)
    assert again.directory is not None  # another config: from_pretrained
