"""How long training stops for a checkpoint: written in the background vs synchronously, same run.

Runs one node twice (checkpoint.background true, then false) and prints the median pause of the
training thread per checkpoint (the trainer's `checkpoint_pause_s`), their ratio, and whether both
runs ended with the same loss.

    python launch/bench/checkpoint_pause.py [--config configs/cpu-demo.toml] [--steps 40] [--every 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(config: str, steps: int, every: int, background: bool, run_dir: Path) -> tuple[list[float], float]:
    subprocess.run([sys.executable, "-m", "prime.train", "--config", config, "--run-dir", str(run_dir),
                    "--train.max_steps", str(steps), "--checkpoint.every", str(every), "--train.eval_every", "0",
                    "--checkpoint.background", str(background).lower(), "--quiet"],
                   cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True, capture_output=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    pauses = [r["checkpoint_pause_s"] for r in records if "checkpoint_pause_s" in r]
    return pauses, [r["loss"] for r in records if "loss" in r][-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="example: python launch/bench/checkpoint_pause.py --steps 40 --every 10")
    parser.add_argument("--config", default="configs/cpu-demo.toml")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        background, loss_bg = run(args.config, args.steps, args.every, True, Path(tmp) / "background")
        synchronous, loss_sync = run(args.config, args.steps, args.every, False, Path(tmp) / "synchronous")
    bg, sync = statistics.median(background), statistics.median(synchronous)
    print(f"{args.config}, {args.steps} steps, a checkpoint every {args.every}: training paused per checkpoint "
          f"(median of {len(background)}) {bg:.3f} s in the background vs {sync:.3f} s synchronously: "
          f"{sync / bg:.1f}x shorter; final loss {loss_bg} vs {loss_sync} ({'same' if loss_bg == loss_sync else 'DIFFERENT'})")
    return 0 if loss_bg == loss_sync else 1


if __name__ == "__main__":
    sys.exit(main())
