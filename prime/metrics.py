"""Where numbers go: metrics.jsonl in the run directory, optionally wandb, and a progress display."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)


class MetricsConfig(BaseModel):
    """Metric sinks. metrics.jsonl is always written by local rank 0."""

    model_config = ConfigDict(extra="forbid")

    wandb: bool = Field(False, description="Also log to Weights & Biases (pip install 'prime[wandb]').")
    wandb_project: str = Field("prime", description="wandb project.")
    wandb_mode: str = Field("offline", description="wandb mode: offline works with no network; online syncs.")
    progress: bool = Field(True, description="Show a progress bar when stdout is a terminal.")


class MetricsWriter:
    """Appends one JSON object per event to metrics.jsonl; forwards to wandb when configured."""

    def __init__(self, run_dir: Path, config: MetricsConfig, run_name: str, enabled: bool,
                 wandb_config: dict | None = None) -> None:
        self.enabled = enabled
        self._file = None
        self._wandb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(run_dir / "metrics.jsonl", "a", buffering=1, encoding="utf-8")
        if config.wandb:
            try:
                import wandb
            except ImportError:
                raise RuntimeError("metrics.wandb = true but wandb is not installed; pip install 'prime[wandb]'") from None
            self._wandb = wandb.init(project=config.wandb_project, name=run_name, mode=config.wandb_mode,
                                     dir=str(run_dir), config=wandb_config or {})

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        self._file.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            step = record.get("step")
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


class Progress:
    """A progress bar on a terminal; a log line every `every` steps otherwise."""

    def __init__(self, total: int, start: int, enabled: bool, every: int, prefix: str, quiet: bool = False) -> None:
        # Only one process per node speaks; `quiet` keeps events (eval, checkpoints) but drops per-step output.
        self.enabled, self.quiet, self.every, self.prefix = enabled, quiet, every, prefix
        self._bar = None
        if enabled and not quiet and sys.stderr.isatty() and not os.environ.get("PRIME_PLAIN_LOGS"):
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, desc=prefix, unit="step", dynamic_ncols=True)

    def update(self, step: int, text: str) -> None:
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(text, refresh=False)
        elif self.enabled and not self.quiet and step % self.every == 0:
            log.info("%s step %d %s", self.prefix, step, text)

    def note(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(f"{self.prefix} {text}")
        elif self.enabled:
            log.info("%s %s", self.prefix, text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
