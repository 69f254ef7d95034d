"""The one command-line dialect of every entry point (training, the RL roles, the coordinator, the
broadcast): `--config FILE` (TOML), then `--key VALUE` overrides of the entry point's config model,
dotted into nested sections (`--optim.lr 3e-4`, `--env.name math`), beside a few flags of its own that
are not configuration (where things are: tokens, directories, addresses).

    line = CommandLine("python -m prime.rl.trainer", "The RL trainer.", RLTrainerConfig,
                       flags=[Flag("run-dir", "checkpoints go here", required=True)])
    parsed = line.parse(argv)          # --help prints the flags and every config field, exits 0
    parsed.config, parsed.flags["run_dir"]

One rule for names: `-` and `_` are the same in an option (`--run-dir` is `--run_dir`, `--lease-s` is
`lease_s`). A boolean may stand alone (`--public_status` is `--public_status true`). Every error names
the field and the fix, and is one kind (ConfigError; parse() turns it into exit status 2). The old
`--set KEY=VALUE` spelling of the RL roles still works for this release, with a warning naming the new.
"""

from __future__ import annotations

import logging
import sys
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import tomllib
from pydantic import BaseModel, ValidationError

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A command line or configuration that cannot run; the message says which field and how to fix it."""


@dataclass(frozen=True)
class Flag:
    """An option that is not configuration. name: as written after `--` (`run-dir`); it arrives in
    Parsed.flags under its name with `_` (`run_dir`)."""

    name: str
    help: str
    switch: bool = False  # takes no value: present means True
    required: bool = False
    default: Any = None
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] = ()
    metavar: str = "VALUE"

    @property
    def key(self) -> str:
        return _norm(self.name)


@dataclass(frozen=True)
class Positional:
    """Arguments without `--` (a list when `many`)."""

    name: str
    help: str
    many: bool = False
    type: Callable[[str], Any] = str


@dataclass
class Parsed:
    config: BaseModel | None
    flags: dict[str, Any]
    sections: dict[str, BaseModel] = field(default_factory=dict)  # apart from the config: e.g. chaos
    positionals: dict[str, Any] = field(default_factory=dict)


class CommandLine:
    """The parser of one entry point (or one subcommand of it). config: its config model (None: flags
    only). sections: models configured by `--PREFIX.key VALUE` apart from the config (fault injection,
    which must never reach a job's config and fingerprint)."""

    def __init__(self, prog: str, summary: str, config: type[BaseModel] | None = None,
                 flags: Sequence[Flag] = (), *, positionals: Sequence[Positional] = (),
                 sections: dict[str, type[BaseModel]] | None = None, examples: Sequence[str] = (),
                 notes: str = "") -> None:
        self.prog, self.summary, self.config = prog, summary, config
        self.flags: dict[str, Flag] = {}
        if config is not None:
            self.flags["config"] = Flag("config", f"TOML file of {config.__name__} fields (overrides follow as "
                                                  "--key VALUE)", type=Path, metavar="FILE")
        self.flags.update({f.key: f for f in flags})
        self.positionals, self.sections = list(positionals), dict(sections or {})
        self.examples, self.notes = list(examples), notes

    # ---- parsing ---------------------------------------------------------------------------------
    def parse(self, argv: Sequence[str] | None = None) -> Parsed:
        """Parses argv (default sys.argv[1:]); prints help and exits 0 on --help, prints the error and
        exits 2 on a ConfigError."""
        argv = list(sys.argv[1:] if argv is None else argv)
        if "-h" in argv or "--help" in argv:
            print(self.help())
            raise SystemExit(0)
        try:
            return self.parse_or_raise(argv)
        except ConfigError as e:
            print(f"{self.prog}: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None

    def parse_or_raise(self, argv: Sequence[str]) -> Parsed:
        flags: dict[str, Any] = {}
        overrides: dict[str, str] = {}
        sections: dict[str, dict[str, str]] = {prefix: {} for prefix in self.sections}
        loose: list[str] = []
        args = list(argv)
        i = 0
        while i < len(args):
            arg = args[i]
            i += 1
            if not arg.startswith("--") or arg == "--":
                loose.append(arg)
                continue
            name, eq, value = arg[2:].partition("=")
            key = _norm(name)
            flag = self.flags.get(key)
            if key == "set" and flag is None:  # the RL roles' old spelling: --set KEY=VALUE
                if not eq:
                    if i >= len(args):
                        raise ConfigError("--set needs KEY=VALUE")
                    value, i = args[i], i + 1
                dotted, eq2, text = value.partition("=")
                if not eq2 or not dotted:
                    raise ConfigError(f"--set {value!r}: write --KEY VALUE, e.g. --async_level 2")
                log.warning("--set %s is the old spelling and goes in the next release: write --%s %s", value,
                            dotted, text)
                self._place(_norm(dotted), text, overrides, sections)
                continue
            if flag is not None and flag.switch:
                if eq:
                    raise ConfigError(f"--{flag.name} takes no value")
                flags[flag.key] = True
                continue
            if not eq:
                if flag is None and self._is_bool(key) and (i >= len(args) or args[i].startswith("--")):
                    value = "true"
                elif i >= len(args):
                    raise ConfigError(f"--{name} needs a value")
                else:
                    value, i = args[i], i + 1
            if flag is not None:
                flags[flag.key] = self._flag_value(flag, value)
            else:
                self._place(key, value, overrides, sections)
        for flag in self.flags.values():
            if flag.key not in flags:
                if flag.required:
                    raise ConfigError(f"--{flag.name} is required: {flag.help}")
                flags[flag.key] = False if flag.switch else flag.default
        positionals = self._positionals(loose)
        config = None
        if self.config is not None:
            config = load_config_file(self.config, flags.get("config"), overrides)
        loaded = {prefix: load_config_file(model, None, sections[prefix], prefix=f"{prefix}.")
                  for prefix, model in self.sections.items()}
        return Parsed(config, flags, loaded, positionals)

    def _place(self, key: str, value: str, overrides: dict[str, str], sections: dict[str, dict[str, str]]) -> None:
        prefix, dot, rest = key.partition(".")
        if dot and prefix in self.sections:
            sections[prefix][rest] = value
            return
        # A key inside a known section goes on to validation, which names the section's keys.
        if self.config is None or prefix not in self.config.model_fields:
            known = ", ".join(f"--{f.name}" for f in self.flags.values())
            fields = f"; config fields: {', '.join(self.config.model_fields)}" if self.config is not None else ""
            raise ConfigError(f"unknown option --{key}; the options are {known}{fields} (--help lists them all)")
        overrides[key] = value

    def _is_bool(self, key: str) -> bool:
        prefix, dot, rest = key.partition(".")
        model = self.sections[prefix] if dot and prefix in self.sections else self.config
        path = rest if dot and prefix in self.sections else key
        return model is not None and _field_annotation(path, model) is bool

    @staticmethod
    def _flag_value(flag: Flag, text: str) -> Any:
        if flag.choices and text not in flag.choices:
            raise ConfigError(f"--{flag.name} {text!r}: choose one of {', '.join(flag.choices)}")
        try:
            return flag.type(text)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"--{flag.name} {text!r}: {e}") from None

    def _positionals(self, loose: list[str]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        rest = list(loose)
        for p in self.positionals:
            if p.many:
                if not rest:
                    raise ConfigError(f"{p.name} is required: {p.help}")
                out[p.name], rest = [p.type(v) for v in rest], []
            else:
                if not rest:
                    raise ConfigError(f"{p.name} is required: {p.help}")
                out[p.name] = p.type(rest.pop(0))
        if rest:
            raise ConfigError(f"unexpected argument {rest[0]!r}; options look like --config FILE or --key VALUE")
        return out

    # ---- help ------------------------------------------------------------------------------------
    def help(self) -> str:
        usage = [f"usage: {self.prog}"]
        for f in self.flags.values():
            text = f"--{f.name}" if f.switch else f"--{f.name} {f.metavar}"
            usage.append(text if f.required else f"[{text}]")
        usage += [f"{p.name} ..." if p.many else p.name for p in self.positionals]
        if self.config is not None:
            usage.append("[--key VALUE ...]")
        lines = [" ".join(usage), "", self.summary, ""]
        if self.examples:
            lines += ["examples:", *[f"  {e}" for e in self.examples], ""]
        lines.append("options:")
        for f in self.flags.values():
            head = f"--{f.name}" if f.switch else f"--{f.name} {f.metavar}"
            extra = f" (one of {', '.join(f.choices)})" if f.choices else ""
            default = f" (default {f.default})" if f.default not in (None, False, "") else ""
            lines.append(_wrapped(f"  {head:24s} {f.help}{extra}{default}"))
        for p in self.positionals:
            lines.append(_wrapped(f"  {p.name:24s} {p.help}"))
        lines.append("  -h, --help               this text")
        if self.notes:
            lines += ["", self.notes.strip()]
        if self.config is not None:
            lines += ["", f"config fields ({self.config.__name__}; in the TOML file, or --key VALUE, dotted into "
                          "sections):", *describe_fields(self.config)]
        for prefix, model in self.sections.items():
            lines += ["", f"{prefix} ({model.__doc__.strip().splitlines()[0] if model.__doc__ else model.__name__}):",
                      *describe_fields(model, f"{prefix}.")]
        return "\n".join(lines)


class Commands:
    """An entry point of several commands (`serve`, `token create`, ...), each a CommandLine (or a
    Commands of its own) whose prog names the command."""

    def __init__(self, prog: str, summary: str, commands: dict[str, "CommandLine | Commands"]) -> None:
        self.prog, self.summary, self.commands = prog, summary, dict(commands)

    def parse(self, argv: Sequence[str] | None = None) -> tuple[list[str], Parsed]:
        """(the command's words, what its CommandLine parsed); help and errors as CommandLine.parse."""
        argv = list(sys.argv[1:] if argv is None else argv)
        if not argv or argv[0] in ("-h", "--help"):
            print(self.help())
            raise SystemExit(0 if argv else 2)
        name, rest = argv[0], argv[1:]
        command = self.commands.get(name)
        if command is None:
            print(f"{self.prog}: error: unknown command {name!r}; the commands are {', '.join(self.commands)}",
                  file=sys.stderr)
            raise SystemExit(2)
        if isinstance(command, Commands):
            words, parsed = command.parse(rest)
            return [name, *words], parsed
        return [name], command.parse(rest)

    def help(self) -> str:
        lines = [f"usage: {self.prog} {{{','.join(self.commands)}}} ...", "", self.summary, "", "commands:"]
        for name, command in self.commands.items():
            lines.append(f"  {name:24s} {command.summary.splitlines()[0]}")
        lines.append(f"\n{self.prog} COMMAND --help: that command's options")
        return "\n".join(lines)


# ---- the config itself: TOML, then overrides, validated by its model ---------------------------------
def load_config_file(schema: type[BaseModel], path: str | Path | None, overrides: dict[str, str] | None = None,
                     prefix: str = "") -> BaseModel:
    """A `schema` (a pydantic model) from a TOML file (or its defaults), with dotted overrides (text,
    read as TOML values except where the field is text), validated; ConfigError names each bad field
    and the fix."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist" + ("; see configs/ for the shipped ones"
                                                                      if Path("configs").is_dir() else ""))
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
    for dotted, text in (overrides or {}).items():
        set_dotted(raw, dotted, parse_value(dotted, text, schema), prefix)
    try:
        return schema.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(describe_error(e, path, schema, prefix)) from None


def renamed_keys(data: object, renames: dict[str, str], section: str) -> object:
    """For a model's before-validator: keys renamed in this release still work, with a warning naming
    the new one (`section`: where they live, e.g. "mesh"); they go in the next release."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    for old, new in renames.items():
        if old in data:
            log.warning("%s.%s is the old name and goes in the next release: write %s.%s", section, old, section, new)
            if new in data:
                raise ConfigError(f"{section}.{old} and {section}.{new} are the same setting; keep {section}.{new}")
            data[new] = data.pop(old)
    return data


def set_dotted(raw: dict, dotted: str, value: object, prefix: str = "") -> None:
    keys = dotted.split(".")
    node = raw
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--{prefix}{dotted}: {key} is a value, not a section")
        node = child
    node[keys[-1]] = value


def parse_value(dotted: str, text: str, root: type[BaseModel]) -> object:
    """Strings stay strings (a path named "1e3" is still a path); anything else is read as a TOML value."""
    annotation = _field_annotation(dotted, root)
    if _is_text_field(annotation):
        return None if text in ("None", "null") and type(None) in typing.get_args(annotation) else text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def describe_error(error: ValidationError, path: Path | None, root: type[BaseModel], prefix: str = "") -> str:
    where = f" in {path}" if path else ""
    lines = [f"invalid configuration{where}:"]
    for item in error.errors():
        name = prefix + ".".join(str(p) for p in item["loc"]) if item["loc"] else "(top level)"
        if item["type"] == "extra_forbidden":
            parent = ".".join(str(p) for p in item["loc"][:-1])
            section = _field_annotation(parent, root) if parent else root
            known = sorted(section.model_fields) if isinstance(section, type) and issubclass(section, BaseModel) else []
            lines.append(f"  {name}: unknown key; known keys here: {', '.join(known)}")
        else:
            message = item["msg"].removeprefix("Value error, ")
            lines.append(f"  {name}: {message} (got {item.get('input')!r})" if item["loc"] else f"  {message}")
    return "\n".join(lines)


def describe_fields(schema: type[BaseModel], prefix: str = "") -> list[str]:
    """One line per configurable field, for --help."""
    lines = []
    for name, info in schema.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines.extend(describe_fields(annotation, f"{prefix}{name}."))
        else:
            default = info.default if info.default_factory is None else info.default_factory()
            lines.append(_wrapped(f"  --{prefix}{name} (default {default!r}): {info.description or ''}"))
    return lines


def _wrapped(line: str, width: int = 110) -> str:
    return textwrap.fill(line, width, subsequent_indent=" " * 27, break_on_hyphens=False)


def _norm(name: str) -> str:
    return name.replace("-", "_")


def _field_annotation(dotted: str, root: type[BaseModel]) -> object | None:
    model: object = root
    annotation: object | None = None
    for key in dotted.split("."):
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or key not in model.model_fields:
            return None
        annotation = model.model_fields[key].annotation
        model = annotation
    return annotation


def _is_text_field(annotation: object) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return str in typing.get_args(annotation)
    return annotation is str or origin is typing.Literal
