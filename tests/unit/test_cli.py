"""The one command-line dialect (elastic_mesh/cli.py) every entry point speaks."""

import logging
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from elastic_mesh.cli import CommandLine, Commands, ConfigError, Flag, Positional


class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lr: float = 1e-3
    name: str = "x"


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = Field(10, gt=0)
    wait_s: float = 1.0
    public: bool = False
    mode: Literal["a", "b"] = "a"
    inner: Inner = Field(default_factory=Inner)


class Chaos(BaseModel):
    """Faults."""
    model_config = ConfigDict(extra="forbid")
    kill_at: int = 0


LINE = CommandLine("prog", "A test entry point.", Settings,
                   [Flag("run-dir", "where", required=True, type=Path), Flag("quiet", "less", switch=True)],
                   sections={"chaos": Chaos})


def test_config_file_then_dotted_overrides(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("steps = 3\n[inner]\nlr = 0.5\nname = 'y'\n")
    parsed = LINE.parse_or_raise(["--config", str(toml), "--inner.lr", "0.25", "--run-dir", "r", "--mode", "b"])
    assert parsed.config == Settings(steps=3, mode="b", inner=Inner(lr=0.25, name="y"))
    assert parsed.flags == {"config": toml, "run_dir": Path("r"), "quiet": False}


def test_dash_and_underscore_are_the_same_and_a_boolean_may_stand_alone():
    parsed = LINE.parse_or_raise(["--run_dir", "r", "--wait-s", "2.5", "--public", "--quiet"])
    assert parsed.config.wait_s == 2.5 and parsed.config.public is True and parsed.flags["quiet"] is True
    assert LINE.parse_or_raise(["--run-dir", "r", "--public", "false"]).config.public is False
    assert LINE.parse_or_raise(["--run-dir=r", "--steps=7"]).config.steps == 7


def test_text_fields_stay_text():
    assert LINE.parse_or_raise(["--run-dir", "r", "--inner.name", "1e3"]).config.inner.name == "1e3"


def test_sections_apart_from_the_config():
    parsed = LINE.parse_or_raise(["--run-dir", "r", "--chaos.kill_at", "4"])
    assert parsed.sections["chaos"] == Chaos(kill_at=4) and "chaos" not in parsed.config.model_dump()
    with pytest.raises(ConfigError, match="chaos.kill_att: unknown key; known keys here: kill_at"):
        LINE.parse_or_raise(["--run-dir", "r", "--chaos.kill_att", "4"])


@pytest.mark.parametrize("argv, message", [
    (["--run-dir", "r", "--inner.lrr", "1"], "inner.lrr: unknown key; known keys here: lr, name"),
    (["--run-dir", "r", "--stepz", "1"], "unknown option --stepz; the options are --config, --run-dir, --quiet; "
                                         "config fields: steps, wait_s, public, mode, inner"),
    (["--run-dir", "r", "--steps", "0"], "steps: Input should be greater than 0 (got 0)"),
    (["--run-dir", "r", "--mode", "c"], "mode: Input should be 'a' or 'b'"),
    (["--steps", "2"], "--run-dir is required: where"),
    (["--run-dir"], "--run-dir needs a value"),
    (["--run-dir", "r", "--quiet=yes"], "--quiet takes no value"),
    (["--run-dir", "r", "stray"], "unexpected argument 'stray'"),
    (["--run-dir", "r", "--config", "/nonexistent.toml"], "config file /nonexistent.toml does not exist"),
])
def test_every_error_names_the_field_and_the_fix(argv, message):
    with pytest.raises(ConfigError) as caught:
        LINE.parse_or_raise(argv)
    assert message in str(caught.value)


def test_the_old_set_spelling_still_works_and_says_the_new_one(caplog):
    with caplog.at_level(logging.WARNING):
        parsed = LINE.parse_or_raise(["--run-dir", "r", "--set", "inner.lr=0.1", "--set=steps=4"])
    assert parsed.config.inner.lr == 0.1 and parsed.config.steps == 4
    assert "--set inner.lr=0.1 is the old spelling and goes in the next release: write --inner.lr 0.1" in caplog.text
    with pytest.raises(ConfigError, match="write --KEY VALUE"):
        LINE.parse_or_raise(["--run-dir", "r", "--set", "steps"])


def test_flags_only_positionals_and_commands(capsys):
    token = CommandLine("tool revoke", "Revoke.", None, [Flag("state-dir", "state", required=True)],
                        positionals=[Positional("token_id", "which")])
    tool = Commands("tool", "A tool.", {"token": Commands("tool token", "Tokens.", {"revoke": token})})
    words, parsed = tool.parse(["token", "revoke", "abc", "--state-dir", "s"])
    assert words == ["token", "revoke"] and parsed.positionals == {"token_id": "abc"} and parsed.config is None
    with pytest.raises(SystemExit) as exit:
        tool.parse(["tokens"])
    assert exit.value.code == 2 and "unknown command 'tokens'; the commands are token" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        tool.parse(["token", "--help"])
    assert exit.value.code == 0 and "revoke" in capsys.readouterr().out


def test_help_lists_flags_and_every_field(capsys):
    with pytest.raises(SystemExit) as exit:
        LINE.parse(["--help"])
    out = capsys.readouterr().out
    assert exit.value.code == 0
    assert all(text in out for text in ("--run-dir", "--inner.lr (default 0.001)", "--chaos.kill_at", "--config FILE"))


@pytest.mark.parametrize("module, words", [
    ("prime.train", []), ("prime.rl.trainer.__main__", []), ("prime.rl.worker.__main__", []),
    ("prime.rl.orchestrator.__main__", []), ("prime.rl.filter", []), ("elastic_mesh.coordinator.__main__", ["serve"]),
    ("elastic_mesh.coordinator.__main__", ["token", "create"]), ("elastic_mesh.broadcast.__main__", ["fetch"])])
def test_every_entry_point_speaks_it(module, words):
    """Each entry point's parser lists its fields in --help and refuses a misspelt one before anything
    starts (prime.train's whole process: test_config.py)."""
    import importlib

    entry = importlib.import_module(module)
    line = getattr(entry, "COMMAND_LINE", None) or getattr(entry, "COMMANDS")
    for word in words:
        line = line.commands[word]
    assert "usage:" in line.help()
    with pytest.raises(ConfigError, match="unknown option --no_such_field"):
        line.parse_or_raise(["--no_such_field", "1"])
