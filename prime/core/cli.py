"""Command-line parsing shared by prime's entry points: a few flags plus dotted config overrides."""

from __future__ import annotations

import logging
import os
import sys


def split_overrides(argv: list[str], flags_with_value: set[str], bool_flags: set[str]) -> tuple[dict, dict]:
    """Separates known flags from `--section.key value` overrides (also `--section.key=value`)."""
    flags: dict[str, object] = {}
    overrides: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise SystemExit(f"unexpected argument {arg!r}; options look like --config FILE or --optim.lr 3e-4")
        name, eq, value = arg[2:].partition("=")
        if name in bool_flags:
            flags[name] = True
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv):
                raise SystemExit(f"--{name} needs a value")
            value = argv[i + 1]
            i += 1
        i += 1
        if name in flags_with_value:
            flags[name] = value
        elif "." in name:
            overrides[name] = value
        else:
            raise SystemExit(f"unknown option --{name}; see --help (config fields are --section.key VALUE)")
    return flags, overrides


def setup_logging(prefix: str = "") -> None:
    level = os.environ.get("PRIME_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format=f"%(asctime)s {prefix}%(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    for noisy in ("datasets", "httpx", "urllib3", "fsspec", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
