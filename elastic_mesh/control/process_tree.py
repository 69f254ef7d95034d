"""Finding and killing a process with all its descendants (torchrun puts each worker in its own session,
so a process group does not cover a whole node)."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def kill_tree(pid: int, sig: int = signal.SIGKILL, include_self: bool = True) -> None:
    """Signals pid's descendants, then pid; processes that already exited are skipped."""
    for target in descendants(pid) + ([pid] if include_self else []):
        if target == os.getpid():
            continue
        try:
            os.kill(target, sig)
        except ProcessLookupError:
            pass
