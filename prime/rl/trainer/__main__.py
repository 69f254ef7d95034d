"""python -m prime.rl.trainer: parse, build, run, close (prime/rl/trainer/trainer.py)."""

from __future__ import annotations

from pathlib import Path

from elastic_mesh import CommandLine, Flag
from prime.core.cli import setup_logging
from prime.rl.token_flags import TOKEN_FLAGS, token_of
from prime.rl.trainer.config import RLTrainerConfig
from prime.rl.trainer.trainer import RLTrainer

COMMAND_LINE = CommandLine(
    "python -m prime.rl.trainer",
    "The RL trainer (trusted): takes GRPO batches from the orchestrator, steps the policy, checkpoints, and\n"
    "publishes each new version through the broadcast. Under torchrun --nproc-per-node N the policy is\n"
    "sharded with FSDP2 over the N local ranks.",
    RLTrainerConfig,
    [*TOKEN_FLAGS,
     Flag("policy", "the HF directory to start from (with toploc.json)", required=True, type=Path, metavar="DIR"),
     Flag("orchestrator", "host:port of the orchestrator", required=True, metavar="HOST:PORT"),
     Flag("run-dir", "checkpoints and metrics.jsonl go here", required=True, type=Path, metavar="DIR"),
     Flag("advertise-host", "host workers reach this trainer's chunk server at", metavar="HOST")],
    examples=["python -m prime.rl.trainer --token-file trainer.token --policy my-policy/ --orchestrator HOST:29500 "
              "--run-dir runs/rl/trainer --max_steps 300"],
)


def main(argv: list[str] | None = None) -> int:
    parsed = COMMAND_LINE.parse(argv)
    setup_logging("[trainer] ")
    flags = parsed.flags
    trainer = RLTrainer.build(parsed.config, token_of(flags), flags["policy"], flags["orchestrator"],
                              flags["run_dir"], flags["advertise_host"])
    try:
        return trainer.run()
    finally:
        trainer.close()


if __name__ == "__main__":
    raise SystemExit(main())
