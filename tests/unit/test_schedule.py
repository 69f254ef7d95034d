"""Learning-rate schedules have the shapes their names promise."""

import math

import pytest

from prime.core.optim import OptimConfig, lr_factor


def test_warmup_is_linear():
    config = OptimConfig(warmup_steps=10)
    assert [round(lr_factor(config, s, 100), 3) for s in range(3)] == [0.1, 0.2, 0.3]
    assert lr_factor(config, 9, 100) == 1.0


def test_cosine_ends_at_the_floor():
    config = OptimConfig(warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert lr_factor(config, 10, 110) == pytest.approx(1.0)
    assert lr_factor(config, 60, 110) == pytest.approx(0.55)
    assert lr_factor(config, 110, 110) == pytest.approx(0.1)


@pytest.mark.parametrize("schedule, mid_decay", [("wsd", 0.55), ("wsd-sqrt", 1 - 0.9 * math.sqrt(0.5))])
def test_wsd_is_flat_then_decays(schedule, mid_decay):
    config = OptimConfig(warmup_steps=10, schedule=schedule, decay_fraction=0.2, min_lr_ratio=0.1)
    assert lr_factor(config, 50, 100) == 1.0 and lr_factor(config, 79, 100) == 1.0
    assert lr_factor(config, 90, 100) == pytest.approx(mid_decay)
    assert lr_factor(config, 100, 100) == pytest.approx(0.1)
