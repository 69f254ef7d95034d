"""Entry point of one node: `python -m prime.train --config configs/debug.toml [--section.key VALUE ...]`.

Works as a single process and under `torchrun --nproc-per-node N -m prime.train ...`.
"""

from __future__ import annotations

import signal
import sys
import warnings
from pathlib import Path

from elastic_mesh import CommandLine, ConfigError, Flag
from prime.chaos.faults import PREFIX, FaultConfig, FaultHook
from prime.config import JobConfig
from prime.core.cli import setup_logging

COMMAND_LINE = CommandLine(
    "python -m prime.train",
    "Trains one node. Under torchrun, every local rank runs this and the node shards the model with FSDP2.\n"
    "With --join, the node is one DiLoCo replica of a multi-node run (the token names the coordinator).",
    JobConfig,
    [Flag("run-dir", "where metrics.jsonl, logs and checkpoints go (default runs/NAME)", type=Path, metavar="DIR"),
     Flag("join", "join a multi-node run (token from: python -m elastic_mesh.coordinator token create)",
          metavar="TOKEN"),
     Flag("name", "this node's name in the run (default: the host name)", metavar="NAME"),
     Flag("resume", "continue from the newest complete checkpoint in the run directory", switch=True),
     Flag("quiet", "no progress bar", switch=True)],
    sections={PREFIX.rstrip("."): FaultConfig},
    examples=["python -m prime.train --config configs/debug.toml --train.max_steps 50",
              "torchrun --nproc-per-node 2 -m prime.train --config configs/cpu-demo.toml --optim.lr 3e-4",
              "python -m prime.train --config configs/cpu-demo.toml --run-dir runs/demo --resume",
              "torchrun --nproc-per-node 8 -m prime.train --config configs/10B.toml --join prime1.eyJj..."],
    notes="exit status: 0 done; 2 bad config, token or admission; 3 the coordinator dropped or refused the node, or\n"
          "could not be reached; 4 left behind: no other node is in the run and none holds the state it needs\n"
          "(under torchrun the agent exits 1 and logs the rank's status as \"exitcode: N\")\n\n"
          "chaos.*: fault injection, for tests and the chaos harness (not part of the job's config; off by default).",
)


def main(argv: list[str] | None = None) -> int:
    parsed = COMMAND_LINE.parse(argv)
    config, flags, faults = parsed.config, parsed.flags, parsed.sections["chaos"]
    setup_logging()
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")

    import torch

    from elastic_mesh import CoordinatorError
    from prime.core.distributed import close_local_group, init_local_group
    from prime.diloco.attach import attach_to_run
    from prime.diloco.catch_up import LeftBehind
    from prime.pretrain.trainer import Trainer

    torch.set_num_threads(max(1, torch.get_num_threads()))
    run_dir = Path(flags["run_dir"] or Path("runs") / config.name)
    group = init_local_group(config.train.device)
    # torchrun forwards SIGTERM to every rank; unwinding through `finally` lets the node announce it leaves.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    mesh = None
    try:
        try:
            trainer = Trainer(config, group, run_dir, resume=flags["resume"], quiet=flags["quiet"])
            fault_hook = FaultHook(faults) if faults.active else None
            if flags["join"]:
                mesh = attach_to_run(trainer, config.diloco, config.mesh, flags["join"], flags["name"], fault_hook)
            if fault_hook is not None:  # before the DiLoCo hook: a kill at inner step k comes before its outer step
                fault_hook.server = mesh.server if mesh is not None else None
                trainer.add_hook(fault_hook, first=True)
        except (ConfigError, FileNotFoundError, ValueError, CoordinatorError) as e:  # ValueError: a bad token too
            print(f"error: {e}", file=sys.stderr)
            return 2
        if group.is_leader:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.json").write_text(config.model_dump_json(indent=2))
        try:
            record = trainer.run()
        except CoordinatorError as e:
            print(f"error: {e}", file=sys.stderr)
            return 3
        except LeftBehind as e:
            print(f"error: {e}", file=sys.stderr)
            return 4
        finally:
            trainer.close()
        if group.is_leader:
            print(f"done: step {record.get('step')} loss {record.get('loss')} eval_loss {record.get('eval_loss')} "
                  f"-> {run_dir}", file=sys.stderr)
    finally:
        if mesh is not None:
            mesh.close(leave=True)
        close_local_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
