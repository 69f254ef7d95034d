"""Exports a checkpoint's model to Hugging Face format (safetensors + config.json).

    python -m prime.export runs/cpu-demo/checkpoints/step_00000300 --out exported/cpu-demo

The result loads with `transformers.AutoModelForCausalLM.from_pretrained(out)`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch


def export_checkpoint(checkpoint: Path, out: Path) -> Path:
    from prime.checkpoint import CheckpointStore
    from prime.config import JobConfig
    from prime.model import build_model

    checkpoint = Path(checkpoint)
    trainer_file = checkpoint / "trainer.json"
    if not trainer_file.exists():
        raise FileNotFoundError(
            f"{checkpoint} is not a complete prime checkpoint (no trainer.json); pass a step_* directory"
        )
    config = JobConfig.model_validate(json.loads(trainer_file.read_text())["config"])
    model = build_model(config.model, config.train.seed, "cpu")
    # One process: DCP reassembles the shards that all ranks wrote.
    CheckpointStore.load_model(checkpoint, model)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = Path(config.data.tokenizer).expanduser()
    if config.data.tokenizer != "byte" and tokenizer.exists():
        if tokenizer.is_dir():
            shutil.copytree(tokenizer, out, dirs_exist_ok=True)
        else:
            shutil.copy(tokenizer, out / "tokenizer.json")
    (out / "prime.json").write_text(json.dumps({"checkpoint": str(checkpoint.resolve()),
                                                "tokenizer": config.data.tokenizer}, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Export a prime checkpoint to Hugging Face format (safetensors).",
        epilog="example: python -m prime.export runs/cpu-demo/checkpoints/step_00000300 --out exported/cpu-demo",
    )
    parser.add_argument("checkpoint", type=Path, help="a checkpoint directory (RUN_DIR/checkpoints/step_*)")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    args = parser.parse_args(argv)
    try:
        with torch.no_grad():
            out = export_checkpoint(args.checkpoint, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
