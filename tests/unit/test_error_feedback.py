"""Error feedback of the sparse compression (prime/diloco/error_feedback.py) and the spans it keeps per
fragment (OuterOptimizer.span)."""

from __future__ import annotations

import pytest
import torch

from elastic_mesh import SparseCodec
from prime.diloco.error_feedback import ErrorFeedback
from prime.diloco.outer_optimizer import OuterOptimizer


def test_fragment_spans_are_the_consecutive_runs_their_pseudo_gradients_cover():
    shards = [torch.randn(7, 3), torch.randn(50), torch.randn(4, 4)]
    outer = OuterOptimizer(shards, lr=1.0, momentum=0.0, fragments=4)
    spans = [outer.span(f) for f in range(4)]
    assert spans[0][0] == 0 and spans[-1][1] == 87 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    moved = [s - 1 for s in shards]
    whole = outer.pseudo_gradient(moved)
    for f, (lo, hi) in enumerate(spans):
        assert torch.equal(outer.pseudo_gradient(moved, f), whole[lo:hi])
    assert outer.span(None) == (0, 87)


def test_what_is_not_sent_is_owed_and_nothing_is_lost_without_decay():
    codec = SparseCodec(256, 8, 2, "rice")
    feedback = ErrorFeedback(1024, decay=1.0)
    g = torch.randn(1024, generator=torch.Generator().manual_seed(0))
    sent_total = torch.zeros(1024)
    for _ in range(40):
        offered = feedback.compensate(g, (0, 1024))
        sent = codec.decode(codec.encode(offered), 1024)
        feedback.settle((0, 1024), offered, sent)
        sent_total += sent
    # Everything offered is either sent or still owed (up to float rounding), and the debt stays bounded:
    # a value grows until it is among the largest of its chunk, then goes out.
    assert torch.allclose(sent_total + feedback.residual, 40 * g, atol=1e-3)
    assert feedback.residual.abs().max() < 40 * g.abs().max() / 4
    assert float(sent_total @ g) / float(sent_total.norm() * g.norm()) > 0.95


def test_a_contribution_left_out_leaves_the_residual_and_decay_fades_it():
    feedback = ErrorFeedback(8, decay=0.5)
    feedback.residual[:] = 2.0
    offered = feedback.compensate(torch.ones(4), (4, 8))
    assert torch.equal(offered, torch.full((4,), 2.0))  # 1 + 0.5 × 2
    feedback.settle((4, 8), offered, None)  # refused or missed: nothing was sent, nothing changes
    assert torch.equal(feedback.residual, torch.full((8,), 2.0))
    feedback.settle((4, 8), offered, torch.tensor([2.0, 0.0, 0.0, 2.0]))
    assert feedback.residual.tolist() == [2.0] * 4 + [0.0, 2.0, 2.0, 0.0]
    with pytest.raises(ValueError, match="span"):
        feedback.compensate(torch.ones(3), (4, 8))


def test_a_saved_residual_must_fit_and_be_finite():
    feedback = ErrorFeedback(8, decay=0.95)
    with pytest.raises(ValueError, match="another model"):
        feedback.load_state_tensor(torch.zeros(9))
    with pytest.raises(ValueError, match="non-finite"):
        feedback.load_state_tensor(torch.tensor([float("nan")] * 8))
    feedback.load_state_tensor(torch.arange(8.0))
    assert torch.equal(feedback.state_tensor(), torch.arange(8.0))
