"""DiLoCo's exact equivalences: its arithmetic with one node, and data-parallel SGD when H = 1."""

from __future__ import annotations

import datetime
import random

import pytest
import torch
import torch.distributed as dist

from elastic_mesh.wire.codecs import codec_for
from elastic_mesh.wire.collectives import all_reduce_mean
from launch.cluster import LocalCluster
from prime.config import load_config
from prime.core.checkpoint import CheckpointStore
from prime.core.model import build_model
from prime.diloco.outer_optimizer import OuterOptimizer, split_evenly
from tests.conftest import REPO, run_train


def test_one_node_outer_step_is_exactly_its_own_arithmetic():
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))
    torch.manual_seed(0)
    inner = [torch.randn(5, 3), torch.randn(7)]
    outer = OuterOptimizer(inner, lr=0.7, momentum=0.9)
    params = [t.clone() for t in inner]
    buffers = [None, None]
    for _ in range(3):
        for t in inner:  # inner steps move the weights
            t.add_(torch.randn_like(t) * 0.01)
        pseudo = outer.pseudo_gradient(inner)
        result = all_reduce_mean(pg, pseudo, codec_for("none"), [True])
        assert torch.equal(result.mean, pseudo), "a one-member mean must be the tensor itself"
        grads = [p - i for p, i in zip(params, inner)]
        outer.step(result.mean, inner)
        for k, (p, g) in enumerate(zip(params, grads)):
            # torch's SGD with Nesterov, written out: buf = m*buf + g; p -= lr * (g + m*buf)
            buffers[k] = g.clone() if buffers[k] is None else buffers[k].mul_(0.9).add_(g)
            p.add_(g.add(buffers[k], alpha=0.9), alpha=-0.7)
        for p, o, i in zip(params, outer.outer, inner):
            assert torch.equal(p, o) and torch.equal(p, i)


def test_h1_sgd_diloco_equals_data_parallel_sgd(tmp_path, corpus):
    # One shard read at a time: node i's first lease and rank i's first shard are then the same shard.
    common = ["--data.path", str(corpus), "--data.interleave", "1", "--optim.name", "sgd", "--optim.lr", "0.5",
              "--train.grad_clip", "0",
              "--train.max_steps", "3", "--train.eval_every", "0", "--checkpoint.every", "0"]
    # Two DiLoCo nodes, 8 sequences each (3 steps: SGD at lr 0.5 amplifies fp32 rounding after more), averaging every step with plain outer SGD at lr 1...
    diloco = common + ["--diloco.inner_steps", "1", "--diloco.outer_lr", "1.0", "--diloco.outer_momentum", "0",
                       "--diloco.compression", "none"]
    with LocalCluster(tmp_path / "diloco", "configs/debug.toml", diloco,
                      coordinator_args=["--lease-s", "5", "--min-wait-s", "5"]) as c:
        c.run_nodes(["node0", "node1"], 180)
    # ...against one node of two data-parallel ranks on the same 16 sequences per step.
    run_train(["--config", "configs/debug.toml", "--run-dir", str(tmp_path / "dp"), "--train.batch_size", "16",
               *common], nproc=2)
    config = load_config(REPO / "configs/debug.toml")
    initial = build_model(config.model, 0)
    models = {}
    for name, path in (("diloco", tmp_path / "diloco" / "node0"), ("dp", tmp_path / "dp")):
        models[name] = build_model(config.model, 0)
        CheckpointStore.load_model(path / "checkpoints" / "step_00000003", models[name])
    moved = 0.0
    for (key, a), b, init in zip(models["diloco"].state_dict().items(), models["dp"].state_dict().values(),
                                 initial.state_dict().values()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"{key}: max diff {(a - b).abs().max():.2e}"
        moved = max(moved, (a - init).abs().max().item())
    assert moved > 1e-2, "the weights barely moved; the comparison would prove nothing"


def test_adam_moments_move_to_another_optimizer_and_step_identically():
    """What a joiner takes from a peer: the moments and step count, loaded into a fresh AdamW over the same
    weights, make the next step exactly the peer's (fresh moments would not)."""
    from prime.core.optim import adam_state_tensors, load_adam_state

    torch.manual_seed(0)
    peer = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    peer_opt = torch.optim.AdamW(peer.parameters(), lr=1e-2, betas=(0.9, 0.95), foreach=True)
    batches = [torch.randn(5, 8) for _ in range(4)]
    for x in batches[:3]:
        peer(x).square().mean().backward()
        peer_opt.step()
        peer_opt.zero_grad()
    moments = adam_state_tensors(peer_opt, list(peer.parameters()))
    weights = {k: v.clone() for k, v in peer.state_dict().items()}

    def joiner(load: bool) -> torch.nn.Module:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        model.load_state_dict(weights)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), foreach=True)
        if load:
            load_adam_state(opt, list(model.parameters()), moments)
        model(batches[3]).square().mean().backward()
        opt.step()
        return model

    peer(batches[3]).square().mean().backward()
    peer_opt.step()
    taken, fresh = joiner(load=True), joiner(load=False)
    assert all(torch.equal(a, b) for a, b in zip(taken.parameters(), peer.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(fresh.parameters(), peer.parameters()))
    with pytest.raises(ValueError, match="does not fit"):
        load_adam_state(peer_opt, list(peer.parameters())[:2], moments)


def test_moments_mixed_from_two_peers_are_bounded_and_one_peers_are_untouched():
    """A joiner takes each chunk of the AdamW moments from any peer, so a value's exp_avg may come from a
    peer that saw its embedding row and its exp_avg_sq from one that never did (0): AdamW's next step
    would then move it by lr × exp_avg / eps. bound_first_moment clamps exactly such pairs and leaves
    every pair of one history as it is (sparse, noisy and growing gradients alike)."""
    from prime.core.optim import adam_state_tensors, bound_first_moment, load_adam_state

    betas, lr = (0.9, 0.95), 1e-2

    def peer(tokens: range, seed: int) -> tuple[torch.nn.Embedding, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        emb = torch.nn.Embedding(32, 8)
        opt = torch.optim.AdamW(emb.parameters(), lr=lr, betas=betas, foreach=True)
        for step in range(40):
            ids = torch.tensor([t for t in tokens if torch.rand(()) < 0.5] or [tokens[0]])
            (emb(ids) * (1 + step) * torch.randn(len(ids), 8)).sum().backward()  # growing, noisy, sparse
            opt.step()
            opt.zero_grad()
        return emb, opt

    a, a_opt = peer(range(0, 20), 0)   # never sees tokens 20..31
    b, b_opt = peer(range(12, 32), 1)  # never sees tokens 0..11
    for emb, opt in ((a, a_opt), (b, b_opt)):
        own = adam_state_tensors(opt, list(emb.parameters()))
        kept = {k: v.clone() for k, v in own.items()}
        assert bound_first_moment(own, betas) == 0 and all(torch.equal(own[k], kept[k]) for k in own)

    mixed = adam_state_tensors(b_opt, list(b.parameters()))
    mixed["exp_avg"] = adam_state_tensors(a_opt, list(a.parameters()))["exp_avg"]  # chunks from two peers

    def one_step(moments) -> float:
        model = torch.nn.Embedding(32, 8)
        model.load_state_dict(b.state_dict())
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=0.0, foreach=True)
        load_adam_state(opt, list(model.parameters()), moments)
        model(torch.tensor([3, 25])).sum().backward()
        opt.step()
        return float((model.weight - b.weight).detach().abs().max())

    assert one_step({k: v.clone() for k, v in mixed.items()}) > 1000 * lr  # rows 0..11: exp_avg / eps
    changed = bound_first_moment(mixed, betas)
    assert changed >= 12 * 8 and changed < mixed["exp_avg"].numel(), changed
    assert one_step(mixed) < 3 * lr  # an ordinary AdamW step


def test_fragments_cover_every_parameter_once_and_step_alone():
    assert split_evenly([10, 10, 10, 10], 2) == [[(0, 0, 10), (1, 0, 10)], [(2, 0, 10), (3, 0, 10)]]
    # One big tensor is cut, not left to make its fragment the largest.
    assert split_evenly([100, 1, 1, 1], 2) == [[(0, 0, 51)], [(0, 51, 100), (1, 0, 1), (2, 0, 1), (3, 0, 1)]]
    assert split_evenly([2], 3) == [[], [(0, 0, 1)], [(0, 1, 2)]]  # fewer elements than fragments: empty ones
    torch.manual_seed(0)
    inner = [torch.randn(4, 3), torch.randn(7), torch.randn(2, 2).t(), torch.randn(5)]  # one of them strided
    outer = OuterOptimizer(inner, lr=0.7, momentum=0.9, fragments=2)
    assert outer.fragments == [[(0, 0, 12), (1, 0, 2)], [(1, 2, 7), (2, 0, 4), (3, 0, 5)]]  # 14 | 14 elements
    before = [o.clone() for o in outer.outer]
    moved = [t + 0.1 for t in inner]
    pseudo = outer.pseudo_gradient(moved, fragment=1)
    assert pseudo.numel() == 5 + 4 + 5 and torch.allclose(pseudo, torch.full_like(pseudo, -0.1))
    outer.apply(pseudo, fragment=1)
    assert torch.equal(outer.outer[0], before[0])  # fragment 0 untouched, to the element
    assert torch.equal(outer.outer[1][:2], before[1][:2]) and not torch.equal(outer.outer[1][2:], before[1][2:])
    assert all(not torch.equal(a, b) for a, b in zip(outer.outer[2:], before[2:]))
    assert not outer.buffers[0].any() and not outer.buffers[1][:2].any() and outer.buffers[1][2:].all()
    # The same step as one fragment of everything: element for element what torch's SGD does.
    reference = [o.clone().requires_grad_() for o in before]
    sgd = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    for r, full in zip(reference, [torch.zeros(12), torch.cat([torch.zeros(2), pseudo[:5]]), pseudo[5:9], pseudo[9:]]):
        r.grad = full.view_as(r).clone()
    sgd.step()
    assert all(torch.equal(o, r.detach()) for o, r in zip(outer.outer[1:], reference[1:]))
    # Merging keeps the progress made since launch on top of the new outer params, fragment by fragment.
    launched = outer.snapshot(moved, fragment=1)
    later = [t + 0.05 for t in moved]
    outer.merge(later, launched, fragment=1)
    assert torch.allclose(later[1][2:], outer.outer[1][2:] + 0.05, atol=1e-6)
    for i in (2, 3):
        assert torch.allclose(later[i], outer.outer[i].view_as(later[i]) + 0.05, atol=1e-6)
    assert torch.allclose(later[0], moved[0] + 0.05) and torch.allclose(later[1][:2], moved[1][:2] + 0.05)


def test_model_hash_follows_every_write_to_the_outer_params_though_it_rehashes_only_what_changed():
    """digest() keeps each parameter's hash until the tensor's version counter moves: after any of the
    outer optimizer's writes it must equal the hash of a fresh optimizer holding the same params."""
    torch.manual_seed(2)
    outer = OuterOptimizer([torch.randn(40), torch.randn(8, 5), torch.randn(30)], lr=0.7, momentum=0.9, fragments=3)

    def fresh() -> bytes:
        return OuterOptimizer([o.clone() for o in outer.outer], lr=0.7, momentum=0.9).digest()
    seen = {outer.digest()}
    assert outer.digest() == fresh()
    for fragment in (0, 1, 2, 1):
        outer.apply(torch.randn(sum(hi - lo for _, lo, hi in outer.fragments[fragment])), fragment)
        assert outer.digest() == fresh() and outer.digest() not in seen, fragment
        seen.add(outer.digest())
    other = OuterOptimizer([torch.zeros(40), torch.zeros(8, 5), torch.zeros(30)], lr=0.7, momentum=0.9)
    other.digest()
    other.load_state_tensor(outer.state_tensor())  # a joiner's snapshot
    assert other.digest() == outer.digest()
    one = outer.outer[1].view(-1)[7:9]
    one.mul_(1.0001)  # an in-place write through a view moves the base's counter as well
    assert outer.digest() == fresh() and outer.digest() not in seen


def test_fragments_are_equal_to_one_element_and_cover_everything_in_order():
    """Every fragment gets the same window, so the largest sets the rate the link must carry."""
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([1, 3, 64, 200, 257]) for _ in range(rng.randint(1, 9))]
        parts = rng.randint(1, 12)
        fragments = split_evenly(sizes, parts)
        counts = [sum(hi - lo for _, lo, hi in f) for f in fragments]
        assert max(counts) - min(counts) <= 1 and sum(counts) == sum(sizes), (sizes, parts)
        flat = [(i, e) for f in fragments for i, lo, hi in f for e in range(lo, hi)]
        assert flat == [(i, e) for i, size in enumerate(sizes) for e in range(size)], (sizes, parts)


def test_eager_step_is_the_outer_step_the_average_would_give_if_it_were_this_node_s():
    import copy

    torch.manual_seed(1)
    inner = [torch.randn(6), torch.randn(3, 2)]
    outer = OuterOptimizer(inner, lr=0.7, momentum=0.9, fragments=1)
    outer.apply(torch.randn(12))  # a momentum buffer exists
    pseudo = torch.randn(12)
    reference = copy.deepcopy(outer)
    reference.apply(pseudo)
    shards = [torch.zeros(6), torch.zeros(3, 2)]
    state = outer.state_tensor().clone()
    outer.eager_step(shards, pseudo, None)
    assert all(torch.allclose(s, r, atol=1e-6) for s, r in zip(shards, reference.outer))
    assert torch.equal(outer.state_tensor(), state)  # the shared outer state is untouched


def test_mixed_eager_step_estimates_the_average_with_the_others_last_pseudo_gradients():
    import copy

    torch.manual_seed(2)
    outer = OuterOptimizer([torch.randn(5), torch.randn(2, 3)], lr=0.7, momentum=0.9, fragments=1)
    mine, b, c = torch.randn(11), torch.randn(11), torch.randn(11)
    outer.apply((mine + b + c) / 3)
    state = outer.state_tensor().clone()
    fresh = torch.randn(11)

    def resumes_from(estimate: torch.Tensor) -> list[torch.Tensor]:
        reference = copy.deepcopy(outer)
        reference.apply(estimate)
        return reference.outer

    shards = [torch.zeros(5), torch.zeros(2, 3)]
    assert not outer.eager_step(shards, fresh, None, mixed=True)  # nothing remembered yet: its own
    assert all(torch.allclose(s, r, atol=1e-6) for s, r in zip(shards, resumes_from(fresh)))
    cases = [((mine + b + c) / 3, mine, 3, (fresh + b + c) / 3),  # it contributed: its share taken out
             ((b + c) / 2, None, 2, (fresh + b + c) / 3),  # it contributed nothing: the mean is the others'
             (mine, mine, 1, fresh)]  # alone: no others, its own
    for mean, own, nodes, expected in cases:
        outer.remember_others(None, mean, own, nodes)
        assert outer.eager_step(shards, fresh, None, mixed=True) == (nodes > 1 or own is None)
        assert all(torch.allclose(s, r, atol=1e-5) for s, r in zip(shards, resumes_from(expected))), (nodes, own)
    outer.remember_others(None, (mine + b + c) / 3, mine, 3)
    outer.forget_others()  # a catch-up: what it remembered is from before the gap
    assert not outer.eager_step(shards, fresh, None, mixed=True)
    assert torch.equal(outer.state_tensor(), state)  # the shared outer state is untouched
