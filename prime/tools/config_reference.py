"""Writes the settings reference in docs/configuration.md from the pydantic models themselves, so the
page cannot drift from the code: every job field (with its TOML section and command-line form), the
coordinator's options and the fault-injection options.

    python -m prime.tools.config_reference --write docs/configuration.md   # regenerate
    python -m prime.tools.config_reference --check docs/configuration.md   # exit 1 if stale (a test runs it)

Only the part between the BEGIN/END markers is generated; the prose around it is written by hand.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel

from elastic_mesh import BroadcastSettings, CoordinatorConfig, ServiceLimits
from prime.config import JobConfig
from prime.inference.sampling import SamplingParams
from prime.rl.environments.math_answers import MathConfig
from prime.rl.environments.reasoning_gym import ReasoningGymConfig
from prime.rl.environments.reverse import ReverseConfig
from prime.rl.environments.terms import RewardTerms
from prime.rl.grpo import GRPOConfig
from prime.rl.orchestrator.config import OnlineFilter, OrchestratorConfig
from prime.rl.orchestrator.shares import LeaseShares
from prime.rl.trainer.config import RLTrainerConfig
from prime.rl.worker.config import WorkerConfig
from prime.chaos.faults import PREFIX, FaultConfig
from prime.verify.proof import ProofSettings
from prime.verify.thresholds import Limits, ToplocThresholds

BEGIN = "<!-- BEGIN GENERATED: python -m prime.tools.config_reference --write docs/configuration.md -->"
END = "<!-- END GENERATED -->"


def _type_name(annotation: object) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.default if field.default_factory is None else field.default_factory()
    return f"`{value!r}`"


def _cell(text: str) -> str:
    return (text or "").replace("|", "\\|").replace("\n", " ")


def _table(model: type[BaseModel], option, nested: bool = False) -> list[str]:
    """One row per field; `option(name)` is the command-line form of a field. nested: a field that is a
    model of its own (diloco.sparse) gets a row per field of it instead (--diloco.sparse.k)."""
    lines = ["| option | type | default | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if nested and isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            lines += _table(field.annotation, lambda sub, n=name: option(f"{n}.{sub}"), nested)[2:]
            continue
        lines.append(f"| `{option(name)}` | {_cell(_type_name(field.annotation))} | {_default(field)} "
                     f"| {_cell(field.description or '')} |")
    return lines


def generate() -> str:
    out = [BEGIN, ""]
    for section, field in JobConfig.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            doc = (annotation.__doc__ or "").strip().splitlines()[0] if annotation.__doc__ else ""
            out += [f"### `[{section}]` ({annotation.__name__})", ""] + ([doc, ""] if doc else [])
            out += _table(annotation, lambda name, s=section: f"--{s}.{name}", nested=True) + [""]
        else:
            out += [f"### `{section}`", "", _cell(field.description or ""), f"(default {_default(field)};"
                    f" `--{section} VALUE`)", ""]
    out += ["### Coordinator (`python -m elastic_mesh.coordinator serve`)", "",
            (CoordinatorConfig.__doc__ or "").strip(), ""]
    out += _table(CoordinatorConfig, lambda name: f"--{name}") + [""]
    out += ["#### `service.*` (ServiceLimits; the coordinator's, and the RL orchestrator's `service.*` alike)", "",
            (ServiceLimits.__doc__ or "").strip(), ""]
    out += _table(ServiceLimits, lambda name: f"--service.{name}") + [""]
    out += ["### Broadcast members (`python -m elastic_mesh.broadcast {publish,fetch,relay}`)", "",
            (BroadcastSettings.__doc__ or "").strip(), ""]
    out += _table(BroadcastSettings, lambda name: f"--{name}") + [""]
    out += ["### TOPLOC thresholds (`<model dir>/toploc.json`, written by `python -m prime.verify.calibrate`)", "",
            (ToplocThresholds.__doc__ or "").strip() + " Measured, never edited by hand: the calibration "
            "records its honest maxima, margin and conditions beside them.", ""]
    out += _table(ToplocThresholds, lambda name: name) + [""]
    out += ["### Limits of one worker compute dtype (`limits.<dtype>` in toploc.json)", "",
            (Limits.__doc__ or "").strip(), ""]
    out += _table(Limits, lambda name: name) + [""]
    out += ["### Proof shape (`proof` in toploc.json; `--chunk-tokens`, `--topk` of the calibration)", "",
            (ProofSettings.__doc__ or "").strip(), ""]
    out += _table(ProofSettings, lambda name: name) + [""]
    out += ["### Sampling (per request, assigned by the trusted side; checked by the verifier)", "",
            (SamplingParams.__doc__ or "").strip(), ""]
    out += _table(SamplingParams, lambda name: name) + [""]
    out += ["### RL orchestrator (`python -m prime.rl.orchestrator --FIELD VALUE` or `--config FILE.toml`)", "",
            (OrchestratorConfig.__doc__ or "The orchestrator's settings.").strip(), ""]
    out += _table(OrchestratorConfig, lambda name: f"--{name}") + [""]
    for prefix, model in (("env", ReverseConfig), ("env", ReasoningGymConfig), ("env", MathConfig),
                          ("reward_terms", RewardTerms), ("filter", OnlineFilter), ("shares", LeaseShares)):
        out += [f"#### `{prefix}.*` ({model.__name__})", "", (model.__doc__ or "").strip().splitlines()[0], ""]
        out += _table(model, lambda name, p=prefix: f"--{p}.{name}") + [""]
    out += ["### RL trainer (`python -m prime.rl.trainer --FIELD VALUE` or `--config FILE.toml`)", "",
            (RLTrainerConfig.__doc__ or "The trainer's settings.").strip(), ""]
    out += _table(RLTrainerConfig, lambda name: f"--{name}") + [""]
    out += ["#### `grpo.*` (GRPOConfig)", "", "The GRPO objective (the trainer) and its grouping (the loop).", ""]
    out += _table(GRPOConfig, lambda name: f"--grpo.{name}") + [""]
    out += ["### RL inference worker (`python -m prime.rl.worker --FIELD VALUE` or `--config FILE.toml`)", "",
            (WorkerConfig.__doc__ or "").strip(), ""]
    out += _table(WorkerConfig, lambda name: f"--{name}") + [""]
    out += ["### Fault injection (`prime.train --chaos.KEY VALUE`; tests and the chaos harness only)", "",
            (FaultConfig.__doc__ or "").strip() + " Not part of the job's config: its fingerprint and "
            "`config.json` never see these.", ""]
    out += _table(FaultConfig, lambda name: f"--{PREFIX}{name}") + ["", END]
    return "\n".join(out)


def _with_generated(page: str) -> str:
    if BEGIN not in page or END not in page:
        raise SystemExit(f"the page has no {BEGIN!r} ... {END!r} markers to write between")
    head, rest = page.split(BEGIN, 1)
    return head + generate() + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prime.tools.config_reference", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path, metavar="PAGE", help="regenerate the part between the markers of PAGE")
    group.add_argument("--check", type=Path, metavar="PAGE", help="exit 1 if PAGE's generated part is stale")
    args = parser.parse_args(argv)
    page = args.write or args.check
    if not page.exists():
        parser.error(f"{page} does not exist")
    text = page.read_text()
    fresh = _with_generated(text)
    if args.check:
        if fresh != text:
            print(f"{page} is stale; run: python -m prime.tools.config_reference --write {page}", file=sys.stderr)
            return 1
        return 0
    page.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
