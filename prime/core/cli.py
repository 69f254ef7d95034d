"""Logging set-up shared by prime's entry points (their command line is elastic_mesh.cli's one dialect)."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(prefix: str = "") -> None:
    level = os.environ.get("PRIME_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format=f"%(asctime)s {prefix}%(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    for noisy in ("datasets", "httpx", "urllib3", "fsspec", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
