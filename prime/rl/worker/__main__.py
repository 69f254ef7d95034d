"""python -m prime.rl.worker: parse, build, run, close (prime/rl/worker/worker.py)."""

from __future__ import annotations

from pathlib import Path

from elastic_mesh import CommandLine, Flag
from prime.core.cli import setup_logging
from prime.rl.token_flags import TOKEN_FLAGS, token_of
from prime.rl.worker.config import WorkerConfig
from prime.rl.worker.worker import InferenceWorker, Tamper

COMMAND_LINE = CommandLine(
    "python -m prime.rl.worker",
    "An inference worker (untrusted): generates rollouts for leased prompts with the policy version it is\n"
    "told to use, and returns them with TOPLOC proofs. It learns the orchestrator's address from the signed\n"
    "policy manifest.",
    WorkerConfig,
    [*TOKEN_FLAGS,
     Flag("work-dir", "policy versions are kept (and served to other workers) from here", required=True, type=Path,
          metavar="DIR"),
     Flag("port", "port of this worker's chunk server (0: any)", type=int, default=0, metavar="PORT"),
     Flag("advertise-host", "host other workers reach this one at", metavar="HOST")],
    examples=["python -m prime.rl.worker --token-file worker.token --work-dir runs/rl/worker-a --threads 2"],
    notes="exit status: 0 the run ended; 2 the token or the run refused this worker; 3 evicted",
)


def main(argv: list[str] | None = None, tamper: Tamper | None = None) -> int:
    parsed = COMMAND_LINE.parse(argv)
    setup_logging("[worker] ")
    flags = parsed.flags
    worker = InferenceWorker.join(parsed.config, token_of(flags), flags["work_dir"], flags["port"],
                                  flags["advertise_host"], tamper)
    if isinstance(worker, int):  # refused: the exit code says why
        return worker
    try:
        return worker.run()
    finally:
        worker.close()


if __name__ == "__main__":
    raise SystemExit(main())
