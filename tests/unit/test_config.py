"""Bad configs are refused before anything starts, with the field and the fix named."""

import subprocess
import sys

import pytest

from prime.config import ConfigError, load_config
from tests.conftest import REPO, child_env

CONFIGS = sorted((REPO / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_configs_validate(path):
    config = load_config(path)
    assert config.train.seq_len <= config.model.max_position_embeddings


def test_overrides_are_typed():
    config = load_config(REPO / "configs/debug.toml", {"optim.lr": "3e-4", "train.max_steps": "50",
                                                        "optim.betas": "[0.8, 0.9]", "name": "123"})
    assert config.optim.lr == 3e-4 and config.train.max_steps == 50
    assert config.optim.betas == (0.8, 0.9) and config.name == "123"


@pytest.mark.parametrize("text, eager", [("true", "own"), ("false", "off"), ("mixed", "mixed"), ("own", "own")])
def test_eager_takes_its_modes_and_the_old_booleans(text, eager, caplog):
    assert load_config(REPO / "configs/debug.toml", {"diloco.eager": text}).diloco.eager == eager
    assert ("goes in the next release" in caplog.text) == (text in ("true", "false"))


def test_renamed_mesh_keys_work_this_release_and_say_the_new_name(caplog):
    config = load_config(REPO / "configs/debug.toml", {"mesh.snapshot_keep": "3", "mesh.snapshot_chunk_bytes": "8192"})
    assert config.mesh.keep_rounds == 3 and config.mesh.chunk_bytes == 8192
    assert "mesh.snapshot_keep is the old name and goes in the next release: write mesh.keep_rounds" in caplog.text
    with pytest.raises(ConfigError, match="mesh.snapshot_keep and mesh.keep_rounds are the same setting"):
        load_config(REPO / "configs/debug.toml", {"mesh.snapshot_keep": "3", "mesh.keep_rounds": "4"})


@pytest.mark.parametrize("overrides, expected", [
    ({"optim.lrr": "1"}, "optim.lrr: unknown key; known keys here: betas, decay_fraction"),
    ({"train.max_steps": "many"}, "train.max_steps"),
    ({"train.seq_len": "4096"}, "train.seq_len 4096 exceeds model.max_position_embeddings 256"),
    ({"data.source": "files"}, "data.source = 'files' needs data.path"),
    ({"data.source": "files", "data.path": "/nonexistent/*.jsonl"}, "does not exist"),
    ({"model.num_heads": "5"}, "hidden_size 64 is not divisible by num_heads 5"),
    ({"optim.schedule": "linear"}, "optim.schedule"),
    ({"diloco.mode": "streaming", "diloco.fragments": "2"}, "diloco.inner_steps 5 is not a multiple of diloco.fragments 2"),
    ({"diloco.mode": "streaming", "diloco.inner_steps": "10", "diloco.fragments": "2", "diloco.overlap_steps": "11"},
     "diloco.overlap_steps 11 is over diloco.inner_steps 10"),
    ({"diloco.mode": "delayed", "diloco.overlap_steps": "6"}, "diloco.overlap_steps 6 is over diloco.inner_steps 5"),
    ({"diloco.mode": "overlapped"}, "diloco.mode"),
    ({"diloco.pace": "1.5"}, "diloco.pace"),
    ({"diloco.eager": "average"}, "diloco.eager"),
    ({"diloco.mode": "delayed", "diloco.inner_optimizer": "reset"}, "diloco.inner_optimizer reset is for the blocking"),
    ({"data.interleave": "0"}, "data.interleave"),
])
def test_bad_values_are_named(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs/debug.toml", overrides)
    assert expected in str(err.value)


def test_batch_must_divide_by_micro_batch_and_ranks():
    config = load_config(REPO / "configs/debug.toml", {"train.batch_size": "12", "train.micro_batch_size": "4"})
    with pytest.raises(ConfigError, match=r"batch_size 12 is not divisible by train.micro_batch_size 4 × 2 local "
                                          r"ranks; choose a multiple of 8"):
        config.check_world(2)


def test_tokenizer_larger_than_model_vocab():
    config = load_config(REPO / "configs/debug.toml", {"model.vocab_size": "200"})
    with pytest.raises(ConfigError, match="tokenizer has 259 tokens but model.vocab_size is 200"):
        config.check_tokenizer(259, 257)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_cli_refuses_before_starting(tmp_path):
    cmd = [sys.executable, "-m", "prime.train", "--config", "configs/debug.toml", "--optim.lrr", "1",
           "--run-dir", str(tmp_path / "run")]
    result = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "optim.lrr: unknown key" in result.stderr
    assert not (tmp_path / "run").exists()


def test_help_lists_every_field():
    result = subprocess.run([sys.executable, "-m", "prime.train", "--help"], cwd=REPO, env=child_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "--optim.lr" in result.stdout and "--diloco.inner_steps" in result.stdout and "example" in result.stdout
