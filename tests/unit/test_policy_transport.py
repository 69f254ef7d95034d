"""A policy version as published: the files a worker gets back load into the model the trainer meant,
in float32 bit for bit, or in bfloat16 as the trainer's weights rounded (publish_dtype)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastic_mesh.broadcast.payload import FILES_META
from prime.inference.hf_engine import load_hf_policy
from prime.rl.policy import new_digit_policy
from prime.rl.policy_transport import publish_policy


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
