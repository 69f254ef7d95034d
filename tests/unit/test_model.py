"""Every shipped config builds (on the meta device) with the parameter count it claims."""

import pytest

from prime.config import load_config
from prime.core.model import build_model, count_parameters
from tests.conftest import REPO

EXPECTED_PARAMS = {"debug": (0.1e6, 0.2e6), "cpu-demo": (5e6, 20e6), "150M": (140e6, 160e6),
                   "1B": (1.0e9, 1.2e9), "10B": (10.2e9 * 0.98, 10.2e9 * 1.02)}


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_parameter_count(name):
    config = load_config(REPO / "configs" / f"{name}.toml")
    model = build_model(config.model, seed=0, device="meta")
    low, high = EXPECTED_PARAMS[name]
    assert low <= count_parameters(model) <= high


def test_intellect1_shape():
    config = load_config(REPO / "configs/10B.toml")
    assert (config.model.num_layers, config.model.hidden_size, config.model.num_heads,
            config.model.num_kv_heads, config.model.vocab_size, config.train.seq_len) == (42, 4096, 32, 8, 128256, 8192)
    assert (config.optim.lr, config.optim.betas, config.optim.warmup_steps, config.optim.schedule) == (
        7.5e-5, (0.9, 0.95), 1000, "wsd-sqrt")
    assert (config.diloco.inner_steps, config.diloco.outer_lr, config.diloco.outer_momentum,
            config.diloco.compression) == (100, 0.7, 0.9, "int8")


def test_same_seed_same_weights():
    config = load_config(REPO / "configs/debug.toml")
    a, b = build_model(config.model, 3, "cpu"), build_model(config.model, 3, "cpu")
    c = build_model(config.model, 4, "cpu")
    pa, pb, pc = (next(m.parameters()) for m in (a, b, c))
    assert pa.equal(pb) and not pa.equal(pc)
