"""GRPO's pieces: group advantages, the two-sided clipped token objective, its normalisation, the KL
term, and the built-in reverse environment's verifier."""

from __future__ import annotations

import pytest
import torch

from prime.inference.sampling import SamplingParams, logprobs
from prime.rl.environments.reverse import ReverseConfig, ReverseDigits
from prime.rl.grpo import GRPOConfig, group_advantages, grpo_loss, token_logprobs


def test_advantages_are_normalised_within_each_group_and_flat_groups_are_dropped():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.2, 0.4, 0.6, 0.8]])
    advantages, keep = group_advantages(rewards, GRPOConfig(group_size=4))
    assert keep.tolist() == [True, False, True]
    assert advantages[0].tolist() == pytest.approx([1, -1, -1, 1], abs=1e-3)
    assert advantages[2].mean() == pytest.approx(0, abs=1e-6) and advantages[2].std(unbiased=False) == pytest.approx(1, abs=1e-3)


def test_two_sided_clipping_bounds_the_objective_and_stops_the_gradient_where_clipped():
    config = GRPOConfig(epsilon=0.2, delta=4.0)
    ratios = torch.tensor([0.5, 1.0, 1.5, 5.0])
    old = torch.zeros(2, 4)
    new = torch.log(ratios).repeat(2, 1).requires_grad_(True)
    advantages = torch.tensor([1.0, -1.0])
    loss, stats = grpo_loss(new, old, advantages, torch.ones(2, 4), config)
    # A = +1: min(r, clip(r)) = 0.5, 1.0, 1.2, 1.2; A = -1: -max(r, clip(r)) capped below at -δ = -0.8, -1, -1.5, -4
    expected = (0.5 + 1.0 + 1.2 + 1.2) + (-0.8 - 1.0 - 1.5 - 4.0)
    assert loss.item() == pytest.approx(-expected / 8)
    loss.backward()
    grad = new.grad
    assert grad[0, 2] == 0 and grad[0, 3] == 0  # A > 0 and r above 1 + ε: clipped
    assert grad[1, 3] == 0  # A < 0 and r above δ: capped
    assert grad[0, 0] < 0 and grad[1, 2] > 0  # unclipped: raise r where A > 0, lower it where A < 0
    assert stats["ratio_max"] == pytest.approx(5.0) and stats["delta_capped_fraction"] == pytest.approx(1 / 8)


def test_decoupled_clipping_centres_on_the_proximal_policy_and_weights_by_its_ratio_to_the_generating_one():
    config = GRPOConfig(epsilon=0.2, behaviour_weight_max=2.0)
    old = torch.log(torch.tensor([[0.1, 0.1, 0.4, 0.4]]))
    proximal = torch.log(torch.tensor([[0.15, 0.5, 0.4, 0.4]]))  # the trainer's policy has moved since sampling
    new = torch.log(torch.tensor([[0.15, 0.5, 0.44, 0.6]])).requires_grad_(True)
    loss, stats = grpo_loss(new, old, torch.tensor([1.0]), torch.ones(1, 4), config, proximal=proximal)
    # ratios to proximal 1, 1, 1.1, 1.5 (the last clipped at 1.2); weights 1.5, 5 -> 2 (truncated), 1, 1
    assert loss.item() == pytest.approx(-(1.5 * 1 + 2 * 1 + 1.1 + 1.2) / 4, rel=1e-5)
    loss.backward()
    assert new.grad[0, 3] == 0 and (new.grad[0, :3] < 0).all()  # around the generating version three of four clip
    plain, plain_stats = grpo_loss(new.detach(), old, torch.tensor([1.0]), torch.ones(1, 4), config)
    assert plain_stats["clip_fraction"] == 0.75 and stats["clip_fraction"] == 0.25
    assert stats["ratio_max"] == plain_stats["ratio_max"] == pytest.approx(5.0)  # the log measures the rows' age
    assert stats["behaviour_weight_truncated_fraction"] == 0.25
    same, _ = grpo_loss(new.detach(), old, torch.tensor([1.0]), torch.ones(1, 4), config, proximal=old)
    assert same.item() == pytest.approx(plain.item())  # on-policy rows: the plain objective


def test_the_loss_is_a_mean_over_completion_tokens_not_over_sequences():
    config = GRPOConfig()
    new = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 0, 0], [1.0, 1, 1]])
    loss, _ = grpo_loss(new, new, torch.tensor([1.0, -1.0]), mask, config)
    assert float(loss) == pytest.approx(-(1 - 3) / 4)  # per token: one +1, three -1


def test_kl_to_the_reference_is_zero_at_the_reference_and_positive_elsewhere():
    config = GRPOConfig(kl_coef=0.1)
    new = torch.log(torch.tensor([[0.5, 0.2]]))
    mask = torch.ones(1, 2)
    _, at_reference = grpo_loss(new, new, torch.tensor([0.0]), mask, config, reference=new)
    _, elsewhere = grpo_loss(new, new, torch.tensor([0.0]), mask, config, reference=new + 0.3)
    assert at_reference["kl"] == pytest.approx(0.0) and elsewhere["kl"] > 0


def test_training_logprobs_are_the_ones_workers_report():
    logits = torch.randn(5, 11)
    tokens = torch.randint(0, 11, (5,))
    params = SamplingParams(temperature=0.7)
    assert torch.allclose(token_logprobs(logits, tokens, 0.7), logprobs(logits, tokens, params))


def test_reverse_task_scores_positions_and_keeps_held_out_strings_apart():
    env = ReverseDigits(ReverseConfig(min_digits=4, max_digits=6, eval_tasks=32))
    task = next(env.tasks("train", seed=0))
    assert task.prompt == task.answer[::-1] + "="
    assert env.reward(task, task.answer) == 1.0
    assert env.reward(task, "") == 0.0
    half = task.answer[:len(task.answer) // 2] + "x" * (len(task.answer) - len(task.answer) // 2)
    assert env.reward(task, half) == pytest.approx((len(task.answer) // 2) / len(task.answer))
    assert env.reward(task, task.answer + "12") < 1.0  # extra digits count against it
    train = {t.prompt for _, t in zip(range(2000), env.tasks("train", seed=0))}
    held_out = [t.prompt for t in env.tasks("eval", seed=0)]
    assert len(held_out) == 32 and not train & set(held_out)
    assert held_out == [t.prompt for t in env.tasks("eval", seed=0)]  # the same for the same seed
    with pytest.raises(ValueError):
        ReverseDigits(ReverseConfig(min_digits=5, max_digits=4))


def test_the_synchronous_loop_runs_generate_score_step_on_a_fresh_digit_policy(tmp_path):
    """Two steps of the reference loop on the built-in task: samples are scored by the environment, the
    policy moves, and the held-out reward is measured greedily. (That it learns the task is issue 27.)"""
    from transformers import AutoTokenizer

    from prime.inference.hf_engine import load_hf_policy
    from prime.rl.reference_loop import LoopConfig, run
    from prime.rl.policy import new_digit_policy

    directory = new_digit_policy(tmp_path / "policy", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = load_hf_policy(directory)
    before = [p.detach().clone() for p in model.parameters()]
    records = run(model, tokenizer, ReverseDigits(ReverseConfig(min_digits=4, max_digits=4, eval_tasks=8)),
                  LoopConfig(steps=2, prompts_per_step=4, max_tokens=5, eval_every=2), log=lambda _: None)
    assert [r["step"] for r in records] == [0, 1, 2] and "eval_reward" in records[0] and "eval_reward" in records[2]
    assert {"reward_mean", "groups_kept", "ratio_mean", "clip_fraction", "entropy", "loss"} <= set(records[0])
    assert records[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy: the worker's logprobs are the trainer's
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_the_entropy_bonus_pushes_towards_spread_and_is_off_by_default():
    entropy = torch.tensor([[0.5, 1.0]], requires_grad=True)
    zeros, mask = torch.zeros(1, 2), torch.ones(1, 2)
    loss, stats = grpo_loss(zeros, zeros, torch.tensor([0.0]), mask, GRPOConfig(entropy_coef=0.1), entropy=entropy)
    loss.backward()
    assert entropy.grad.tolist() == [[pytest.approx(-0.05), pytest.approx(-0.05)]]  # more entropy, lower loss
    assert stats["entropy"] == pytest.approx(0.75)
    assert GRPOConfig().entropy_coef == 0.0


def test_a_second_epoch_on_the_same_rows_is_off_policy_and_clipped():
    from prime.rl.update import Row, policy_update

    class Tiny(torch.nn.Module):  # logits straight from an embedding: a policy small enough to reason about
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(6, 6)

        def forward(self, input_ids):
            return type("Output", (), {"logits": self.embedding(input_ids)})()

    torch.manual_seed(0)
    model = Tiny()
    with torch.no_grad():
        old = token_logprobs(model(torch.tensor([[1, 2, 3]])).logits[0, :-1], torch.tensor([2, 3]), 1.0).tolist()
    rows = [Row([1], [2, 3], old, 1.0), Row([1], [2, 3], old, 0.5)]
    stats = policy_update(model, torch.optim.SGD(model.parameters(), lr=5.0), rows, GRPOConfig(), 1.0, pad_id=0,
                          epochs=3)
    assert stats["ratio_mean"] == pytest.approx(1.0) and stats["clip_fraction"] == 0  # the first pass is on-policy
    assert stats["last_ratio_max"] > 1.2 and stats["last_clip_fraction"] > 0  # later ones see the moved policy


def test_the_loop_at_staleness_k_generates_with_the_policy_of_k_updates_ago(tmp_path):
    from transformers import AutoTokenizer

    from prime.inference.hf_engine import load_hf_policy
    from prime.rl.reference_loop import LoopConfig, run
    from prime.rl.policy import new_digit_policy

    directory = new_digit_policy(tmp_path / "policy", seed=0)
    env = ReverseDigits(ReverseConfig(min_digits=4, max_digits=4, eval_tasks=8))
    ratios = {}
    for staleness in (0, 2):
        config = LoopConfig(steps=3, prompts_per_step=8, lr=1e-2, eval_every=3, staleness=staleness)
        records = run(load_hf_policy(directory), AutoTokenizer.from_pretrained(directory), env, config,
                      log=lambda _: None)
        ratios[staleness] = [r["ratio_mean"] for r in records if "ratio_mean" in r]
    assert ratios[0] == pytest.approx([1.0] * 3, abs=1e-4)  # every batch on-policy
    assert ratios[2][0] == pytest.approx(1.0, abs=1e-4)  # nothing older exists yet at the first step
    assert all(abs(r - 1.0) > 1e-3 for r in ratios[2][1:])  # then rows of 1 and 2 updates ago
