"""Where numbers go: metrics.jsonl in the run directory, optionally wandb, and any other sinks (the
terminal display, the coordinator's dashboard)."""

from __future__ import annotations

import json
import logging
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
    progress: bool = Field(True, description="Show a live progress line on a terminal (log lines otherwise).")


class MetricsWriter:
    """Appends one JSON object per event to metrics.jsonl; forwards to wandb when configured."""

    def __init__(self, run_dir: Path, config: MetricsConfig, run_name: str, enabled: bool,
                 wandb_config: dict | None = None) -> None:
        self.enabled, self.config, self.run_dir = enabled, config, run_dir
        self.run_name, self.run_group = run_name, None
        self._file = None
        self._wandb = None
        self._wandb_config = wandb_config or {}
        self.sinks: list = []  # more consumers of every record, e.g. the terminal display, the dashboard
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(run_dir / "metrics.jsonl", "a", buffering=1, encoding="utf-8")
        if config.wandb:
            try:
                import wandb  # noqa: F401  (fail now, not at the first step)
            except ImportError:
                raise RuntimeError("metrics.wandb = true but wandb is not installed; pip install 'prime[wandb]'") from None

    def name_run(self, name: str, group: str | None) -> None:
        """A node of a multi-node run: its wandb run is named after the node and grouped by the run id."""
        if self._wandb is not None:
            raise RuntimeError("name the run before the first record is written")
        self.run_name, self.run_group = name, group

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        self._file.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink(record)
        if self.config.wandb:
            self._log_wandb(record)

    def _log_wandb(self, record: dict) -> None:
        if self._wandb is None:
            import wandb

            self._wandb = wandb.init(project=self.config.wandb_project, name=self.run_name, group=self.run_group,
                                     mode=self.config.wandb_mode, dir=str(self.run_dir), config=self._wandb_config,
                                     job_type="node" if self.run_group else "train")
        values = wandb_metrics(record)
        if values:
            self._wandb.log(values, step=record.get("step"))

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


# metrics.jsonl field -> wandb name, by kind of record. Documented in the README ("Metrics").
_WANDB_NAMES = {
    "outer": {"outer_step": "outer/step", "members": "outer/members", "nodes": "outer/nodes", "attempt": "outer/attempt",
              "epoch": "outer/epoch", "allreduce_s": "outer/allreduce_s", "outer_s": "outer/round_s",
              "bytes_sent": "outer/bytes_sent", "bytes_received": "outer/bytes_received",
              "tokens_contributed": "outer/tokens_contributed"},
    "eval": {"eval_loss": "eval/loss"},
    "train": {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens": "train/tokens",
              "tokens_per_s": "train/tokens_per_s", "mfu": "train/mfu", "step_s": "train/step_s",
              "checkpoint_pause_s": "train/checkpoint_pause_s"},
}


def wandb_metrics(record: dict) -> dict:
    kind = "outer" if "outer_step" in record else "eval" if "eval_loss" in record else "train"
    names = _WANDB_NAMES[kind]
    return {names[k]: v for k, v in record.items()
            if k in names and isinstance(v, (int, float)) and not isinstance(v, bool)}
