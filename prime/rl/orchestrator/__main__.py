"""python -m prime.rl.orchestrator: parse, build, run, close (prime/rl/orchestrator/service.py)."""

from __future__ import annotations

from pathlib import Path

from elastic_mesh import CommandLine, Flag
from prime.core.cli import setup_logging
from prime.rl.orchestrator.config import OrchestratorConfig
from prime.rl.orchestrator.service import OrchestratorService
from prime.rl.token_flags import TOKEN_FLAGS, token_of

COMMAND_LINE = CommandLine(
    "python -m prime.rl.orchestrator",
    "The orchestrator (trusted): hands out prompt leases, verifies and scores rollouts, builds the trainer's\n"
    "batches, serves the dashboard. Started again with the same --run-dir and --port it continues the run.",
    OrchestratorConfig,
    [*TOKEN_FLAGS,
     Flag("run-dir", "metrics, summary and policy copies go here", required=True, type=Path, metavar="DIR"),
     Flag("host", "address to listen on", default="0.0.0.0", metavar="HOST"),
     Flag("port", "port (0: any free one; see RUN_DIR/address)", type=int, default=0, metavar="PORT"),
     Flag("advertise-host", "host the trainer and workers reach this at (default 127.0.0.1); the port is --port's "
          "(or the one picked)", metavar="HOST")],
    examples=["python -m prime.rl.orchestrator --token-file orch.token --run-dir runs/rl/orchestrator --port 29500 "
              "--async_level 2"],
)


def main(argv: list[str] | None = None) -> int:
    parsed = COMMAND_LINE.parse(argv)
    setup_logging("[orchestrator] ")
    flags = parsed.flags
    service = OrchestratorService.build(parsed.config, token_of(flags), flags["run_dir"], flags["host"],
                                        flags["port"], flags["advertise_host"])
    try:
        return service.run()
    finally:
        service.close()


if __name__ == "__main__":
    raise SystemExit(main())
