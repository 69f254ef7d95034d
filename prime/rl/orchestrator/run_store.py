"""Where a restarted orchestrator finds its run: `state.json`, small and rewritten at every change (a
batch built, a worker evicted, the run finished), and each batch the trainer may ask for again in a file
of its own under `batches/`, written once when it is built.

Before, every kept batch was inside state.json and rewritten with it at every batch: with a trainer that
checkpoints every 5 steps (6 batches kept) the file was 245 KB in the async-2 benchmark against 33 KB
with 2, and it grows with the batch size times the checkpoint interval.
"""

from __future__ import annotations

import json
from pathlib import Path


class RunStore:
    """Every write is atomic (a file written beside and renamed), so a stop at any moment leaves either
    the old or the new version of each file. A batch is written before the state that names it, and
    deleted only after a state that no longer names it: the saved state never names a missing batch."""

    def __init__(self, run_dir: Path | None) -> None:
        """run_dir None: nothing is written (a run that cannot be restarted, as in unit tests of others)."""
        self.run_dir = Path(run_dir) if run_dir is not None else None

    @property
    def state_path(self) -> Path | None:
        return self.run_dir / "state.json" if self.run_dir else None

    def _batch_path(self, step: int) -> Path:
        return self.run_dir / "batches" / f"{step:08d}.json"

    def save_batch(self, step: int, batch: dict) -> None:
        if self.run_dir is None:
            return
        path = self._batch_path(step)
        path.parent.mkdir(parents=True, exist_ok=True)
        _write(path, batch)

    def save(self, state: dict) -> None:
        """state: Orchestrator.state(), which names its kept batches by step (`batch_steps`)."""
        if self.run_dir is None:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _write(self.state_path, state)
        kept = set(state.get("batch_steps", []))
        for path in (self.run_dir / "batches").glob("*.json"):
            if path.stem.isdigit() and int(path.stem) not in kept:
                path.unlink(missing_ok=True)

    def load(self) -> dict | None:
        """The saved state with its batches (`batches`: step -> batch), or None for a new run. A state
        from before batches had files of their own holds them inline and is read as it is."""
        if self.state_path is None or not self.state_path.exists():
            return None
        state = json.loads(self.state_path.read_text())
        if "batches" not in state:
            batches = {}
            for step in state.get("batch_steps", []):
                path = self._batch_path(int(step))
                try:
                    batches[int(step)] = json.loads(path.read_text())
                except (OSError, ValueError) as e:
                    raise RuntimeError(f"{self.state_path} names batch {step}, but {path} cannot be read ({e}); "
                                       "the run cannot continue from this state") from None
            state["batches"] = batches
        return state


def _write(path: Path, content: dict) -> None:
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps(content))
    staging.replace(path)
