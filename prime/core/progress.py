"""What a node's terminal shows: a live `rich` line (inner step of H, loss, tokens/s, outer step, time
to the next sync, bytes sent) on a terminal; a plain log line every `every` steps otherwise.

It reads the same records that go to metrics.jsonl (it is one of MetricsWriter's sinks), so it knows
nothing about DiLoCo beyond the fields of an outer-step record.
"""

from __future__ import annotations

import logging
import os
import sys
import time

log = logging.getLogger(__name__)


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


class ProgressDisplay:
    def __init__(self, total: int, start: int, enabled: bool, every: int, prefix: str, quiet: bool = False,
                 console=None) -> None:
        """console: a rich Console to draw on (tests pass one); by default stderr when it is a terminal."""
        # Only one process per node speaks; `quiet` keeps events (eval, checkpoints) but drops per-step output.
        self.total, self.enabled, self.quiet, self.every, self.prefix = total, enabled, quiet, every, prefix
        self.sync_every: int | None = None  # H, set when the node runs DiLoCo
        self.outer_step, self.bytes_sent = 0, 0
        self.step, self.loss, self.tokens_per_s, self.step_s = start, None, None, None
        self._live = None
        if enabled and not quiet and (console is not None or (sys.stderr.isatty() and not os.environ.get("PRIME_PLAIN_LOGS"))):
            self._start_live(console, start)

    def _start_live(self, console, start: int) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self._console = console or Console(file=sys.stderr)
        self._live = Progress(TextColumn("{task.description}", markup=False), BarColumn(bar_width=24),
                              MofNCompleteColumn(), TimeRemainingColumn(), TextColumn("{task.fields[detail]}", markup=False), console=self._console,
                              transient=False, redirect_stderr=console is None, redirect_stdout=False)
        self._task = self._live.add_task(self.prefix, total=self.total, completed=start, detail="starting")
        self._live.start()
        # Log lines go above the live line instead of through it.
        self._handlers = [(h, h.stream) for h in logging.getLogger().handlers
                          if isinstance(h, logging.StreamHandler) and h.stream in (sys.__stderr__, sys.stderr)]
        for handler, _ in self._handlers:
            handler.setStream(self._console.file)

    def observe(self, record: dict) -> None:
        """Takes every metrics record: inner steps, evals, outer steps."""
        if "outer_step" in record:
            self.outer_step = record["outer_step"]
            self.bytes_sent += record.get("bytes_sent", 0)
            return
        if "loss" in record and "step" in record:
            self.step, self.loss = record["step"], record["loss"]
            self.tokens_per_s, self.step_s = record.get("tokens_per_s"), record.get("step_s")
            self._show()

    def detail(self) -> str:
        parts = []
        if self.sync_every:
            inner = (self.step - 1) % self.sync_every + 1 if self.step else 0
            parts.append(f"inner {inner}/{self.sync_every}")
        if self.loss is not None:
            parts.append(f"loss {self.loss:.3f}")
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:,.0f} tok/s")
        if self.sync_every:
            parts.append(f"outer {self.outer_step}")
            left = self.sync_every - self.step % self.sync_every
            if self.step_s is not None and left < self.sync_every:
                parts.append(f"sync in {_duration(left * self.step_s)}")
            parts.append(f"{self.bytes_sent / 1e6:,.1f} MB sent")
        return " · ".join(parts)

    def _show(self) -> None:
        if self._live is not None:
            self._live.update(self._task, completed=self.step, detail=self.detail(), description=self.prefix)
        elif self.enabled and not self.quiet and self.step % self.every == 0:
            log.info("%s step %d/%d %s", self.prefix, self.step, self.total, self.detail())

    def note(self, text: str) -> None:
        """An event worth its own line (eval, checkpoint, outer step)."""
        if self._live is not None:
            self._live.console.print(f"{time.strftime('%H:%M:%S')} {self.prefix} {text}", highlight=False, markup=False)
        elif self.enabled:
            log.info("%s %s", self.prefix, text)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            for handler, stream in self._handlers:
                handler.setStream(stream)
            self._live = None
