"""The job configuration: TOML file + dotted command-line overrides, validated before anything starts.

Each component owns its section's model (next to the code that uses it); this module only composes
them, checks what spans sections, and turns errors into messages that name the field and the fix.
"""

from __future__ import annotations

import hashlib
import json
import types
import typing
from pathlib import Path

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from elastic_mesh.mesh import MeshConfig
from prime.core.checkpoint import CheckpointConfig
from prime.core.metrics import MetricsConfig
from prime.core.model import ModelConfig
from prime.core.optim import OptimConfig
from prime.data.loader import DataConfig
from prime.diloco.config import DilocoConfig
from prime.pretrain.config import TrainConfig


class ConfigError(ValueError):
    """A configuration that cannot run; the message says which field and how to fix it."""


class JobConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("prime", description="Name of the run (used for the run directory and wandb).")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    diloco: DilocoConfig = Field(default_factory=DilocoConfig)
    mesh: MeshConfig = Field(default_factory=MeshConfig)

    @model_validator(mode="after")
    def _check_across_sections(self) -> "JobConfig":
        if self.train.seq_len > self.model.max_position_embeddings:
            raise ValueError(
                f"train.seq_len {self.train.seq_len} exceeds model.max_position_embeddings "
                f"{self.model.max_position_embeddings}; lower train.seq_len or raise the model's positions"
            )
        if self.data.source == "files" and not self.data.path:
            raise ValueError("data.source = 'files' needs data.path (a file, directory or glob of jsonl/parquet/txt)")
        if self.data.source == "hub" and not self.data.hub_name:
            raise ValueError("data.source = 'hub' needs data.hub_name, e.g. 'HuggingFaceFW/fineweb-edu'")
        for name, value in (("data.path", self.data.path), ("data.eval_path", self.data.eval_path)):
            if self.data.source == "files" and value and not _exists(value):
                raise ValueError(f"{name} {value!r} does not exist; point it at a file, directory or glob of data")
        return self

    def check_world(self, local_world_size: int) -> None:
        """Checks that depend on how many processes this node runs."""
        per_step = self.train.micro_batch_size * local_world_size
        if self.train.batch_size % per_step:
            raise ConfigError(
                f"train.batch_size {self.train.batch_size} is not divisible by train.micro_batch_size "
                f"{self.train.micro_batch_size} × {local_world_size} local ranks; choose a multiple of {per_step}"
            )

    def check_tokenizer(self, vocab_size: int, eos_id: int) -> None:
        if vocab_size > self.model.vocab_size or eos_id >= self.model.vocab_size:
            raise ConfigError(
                f"the tokenizer has {vocab_size} tokens but model.vocab_size is {self.model.vocab_size}; "
                f"set model.vocab_size to at least {vocab_size}"
            )

    def grad_accumulation_steps(self, local_world_size: int) -> int:
        return self.train.batch_size // (self.train.micro_batch_size * local_world_size)

    def model_fingerprint(self) -> str:
        """Identifies what must match for nodes to train the same model together."""
        blob = json.dumps({"model": self.model.model_dump(), "seq_len": self.train.seq_len,
                           "tokenizer": self.data.tokenizer, "seed": self.train.seed}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _exists(pattern: str) -> bool:
    import glob

    return Path(pattern).expanduser().exists() or bool(glob.glob(str(Path(pattern).expanduser())))


def load_config(path: str | Path | None, overrides: dict[str, str] | None = None) -> JobConfig:
    """Reads a TOML file (or the defaults), applies dotted overrides, validates everything."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist; see configs/ for the shipped ones")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
    for dotted, text in (overrides or {}).items():
        _set_dotted(raw, dotted, _parse_value(dotted, text))
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_describe(e, path)) from None


def _set_dotted(raw: dict, dotted: str, value: object) -> None:
    keys = dotted.split(".")
    node = raw
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--{dotted}: {key} is a value, not a section")
        node = child
    node[keys[-1]] = value


def load_section(model: type[BaseModel], overrides: dict[str, str], prefix: str) -> BaseModel:
    """A config model that is not part of the job (fault injection), from its own `--PREFIXkey value`
    overrides, parsed and checked like the job's."""
    raw: dict = {}
    for key, text in overrides.items():
        _set_dotted(raw, key, _parse_value(key, text, model))
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        message = _describe(e, None, model).replace("\n  ", f"\n  {prefix}")
        raise ConfigError(message) from None


def _field_annotation(dotted: str, root: type[BaseModel] = JobConfig) -> object | None:
    model: type[BaseModel] = root
    annotation: object | None = None
    for key in dotted.split("."):
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or key not in model.model_fields:
            return None
        annotation = model.model_fields[key].annotation
        model = annotation  # type: ignore[assignment]
    return annotation


def _is_text_field(annotation: object) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return str in typing.get_args(annotation)
    return annotation is str or origin is typing.Literal


def _parse_value(dotted: str, text: str, root: type[BaseModel] = JobConfig) -> object:
    # Strings stay strings (a path named "1e3" is still a path); anything else is read as a TOML value.
    annotation = _field_annotation(dotted, root)
    if _is_text_field(annotation):
        return None if text in ("None", "null") and type(None) in typing.get_args(annotation) else text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _describe(error: ValidationError, path: Path | None, root: type[BaseModel] = JobConfig) -> str:
    where = f" in {path}" if path else ""
    lines = [f"invalid configuration{where}:"]
    for item in error.errors():
        field = ".".join(str(p) for p in item["loc"]) or "(top level)"
        if item["type"] == "extra_forbidden":
            section = _field_annotation(".".join(str(p) for p in item["loc"][:-1]), root) if len(item["loc"]) > 1 else root
            known = sorted(section.model_fields) if isinstance(section, type) and issubclass(section, BaseModel) else []
            lines.append(f"  {field}: unknown key; known keys here: {', '.join(known)}")
        else:
            message = item["msg"].removeprefix("Value error, ")
            lines.append(f"  {field}: {message} (got {item.get('input')!r})" if item["loc"] else f"  {message}")
    return "\n".join(lines)


def describe_fields(model: type[BaseModel] = JobConfig, prefix: str = "") -> list[str]:
    """One line per configurable field, for --help."""
    lines = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines.extend(describe_fields(annotation, f"{prefix}{name}."))
        else:
            default = field.default if field.default_factory is None else field.default_factory()
            lines.append(f"  --{prefix}{name} (default {default!r}): {field.description or ''}")
    return lines
