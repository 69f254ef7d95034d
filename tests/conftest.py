"""Shared fixtures: a small real corpus, and a way to run prime under a real torchrun."""

from __future__ import annotations

import fcntl
import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.cluster import child_env as cluster_env

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """The built-in corpus (stdlib sources), prepared by the real preparation code, 8 shards."""
    from prime.data.builtin_corpus import prepare

    return prepare(tmp_path_factory.mktemp("corpus") / "builtin", shards=8)


def member_processes(module: str):
    """A multiprocessing context whose processes fork from one server that imported torch and `module`
    once: a spawned process spent ~2.5 s of CPU on imports before its first byte (test_collectives.py
    took 121 s, now 10 s). Each is still its own process, with its own Gloo group and sockets."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", module])  # ignored once the server runs
    return ctx


def pytest_collection_modifyitems(config, items):
    # tests/e2e/ holds the end-to-end runs: `pytest -m "not e2e"` is the unit part (under 2 minutes).
    for item in items:
        if "/tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(autouse=True)
def _alone_when_marked(request, tmp_path_factory):
    """`make test` runs two pytest workers (pytest-xdist): most tests wait on processes, sockets and
    timeouts more than they compute. A test marked `alone` (measurements of the WAN emulator, whose
    user-space links need the CPU they model) holds an exclusive lock; every other test a shared one."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    alone = request.node.get_closest_marker("alone") is not None
    with open(tmp_path_factory.getbasetemp().parent / "alone.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def child_env() -> dict[str, str]:
    # Two cores are shared by every simulated process: one thread each, whatever the caller's setting.
    return {**cluster_env(), "OMP_NUM_THREADS": "1"}


def run_train(args: list[str], nproc: int = 1, timeout: float = 240) -> subprocess.CompletedProcess:
    """Runs `prime.train` as a real process (under torchrun when nproc > 1); fails with its output."""
    if nproc > 1:
        cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", "-m", "prime.train", *args]
    else:
        cmd = [sys.executable, "-m", "prime.train", *args]
    result = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
