"""launch/bench/loss_parity.py's bookkeeping: which arms a sweep plans and how results are matched to them
(a result may only be reused for, and compared with, arms of its own length)."""

from __future__ import annotations

from argparse import Namespace
from types import SimpleNamespace

from launch.bench.loss_parity import DEFAULT_STEPS, SWEPT, arm_key, plan, summarise

CONFIG = SimpleNamespace(optim=SimpleNamespace(warmup_steps=50))


def _args(steps: int, **swept) -> Namespace:
    return Namespace(steps=steps, nodes=2, seeds=[0, 1], baselines=True,
                     **{name: swept.get(name) for name in SWEPT})


def test_arms_at_the_default_length_carry_no_length_and_others_carry_theirs():
    short = plan(_args(DEFAULT_STEPS, outer_lr=[0.7]), CONFIG)
    long = plan(_args(450, outer_lr=[0.7]), CONFIG)
    assert len(short) == len(long) == 6  # per seed: DiLoCo, data-parallel, one node
    assert all("steps" not in arm for arm in short)  # results from before the length was recorded still match
    assert all(arm["steps"] == 450 for arm in long)
    assert not {arm_key(a) for a in short} & {arm_key(a) for a in long}  # a 150-step result never stands for 450


def test_ratios_compare_arms_with_baselines_of_the_same_length_and_seeds():
    short, long = plan(_args(DEFAULT_STEPS, outer_lr=[0.7]), CONFIG), plan(_args(450, outer_lr=[0.7]), CONFIG)
    loss = {"diloco": 2.0, "data-parallel": 2.5, "one node": 4.0}
    results = {arm_key(a): loss[a["kind"]] for a in short}
    results |= {arm_key(a): loss[a["kind"]] / 2 for a in long if a["kind"] != "data-parallel"}  # no 450 baseline
    rows = {(r["kind"], r.get("steps", DEFAULT_STEPS)): r for r in summarise(results, short + long)}
    assert rows[("diloco", 150)]["data-parallel"] == 2.5 and rows[("diloco", 150)]["one node"] == 4.0
    assert rows[("diloco", 450)]["one node"] == 2.0
    assert rows[("diloco", 450)]["data-parallel"] is None  # not the 150-step baseline
