"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


@pytest.fixture(scope="session")
def chromium() -> str:
    """Headless Chromium for the dashboards' tests; installed when missing (root + apt), never skipped."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None and shutil.which("apt-get") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for attempt in (["apt-get", "install", "-y", "-q", "chromium"], ["apt-get", "update", "-q"],
                        ["apt-get", "install", "-y", "-q", "chromium"]):  # update only if the first try fails
            subprocess.run(attempt, check=False, capture_output=True, timeout=600, env=env)
            found = shutil.which("chromium")
            if found:
                break
    if found is None:
        pytest.fail("headless Chromium is needed for the dashboard test: apt-get install chromium")
    return found
