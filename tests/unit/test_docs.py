"""The settings reference is generated from the config models: a field added without regenerating the
page fails here, with the command that fixes it."""

import subprocess
import sys

from tests.conftest import REPO


def test_configuration_page_lists_every_field_as_the_code_has_it():
    result = subprocess.run([sys.executable, "-m", "prime.tools.config_reference", "--check", "docs/configuration.md"],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_stale_configuration_page_is_caught(tmp_path):
    page = tmp_path / "configuration.md"
    text = (REPO / "docs" / "configuration.md").read_text()
    page.write_text(text.replace("| `--train.seq_len` |", "| `--train.seq_length` |"))
    result = subprocess.run([sys.executable, "-m", "prime.tools.config_reference", "--check", str(page)],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 1 and "is stale" in result.stderr
