"""What the RL entry points share: a config from an optional TOML file plus `--set key.sub=value`
overrides, validated by its pydantic model; the run token from a flag or a file."""

from __future__ import annotations

from pathlib import Path

import tomllib
from pydantic import BaseModel, ValidationError


def load_config(model: type[BaseModel], path: Path | None, sets: list[str]) -> BaseModel:
    data: dict = tomllib.loads(Path(path).read_text()) if path else {}
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SystemExit(f"--set {item!r}: write KEY=VALUE, e.g. --set async_level=2")
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        try:  # numbers, booleans and lists as TOML reads them; anything else as a string
            node[leaf] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            node[leaf] = value
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise SystemExit(f"invalid {model.__name__}:\n{e}") from None


def read_token_argument(token: str | None, token_file: Path | None) -> str:
    if token_file:
        return Path(token_file).read_text().strip()
    if token:
        return token.strip()
    raise SystemExit("a run token is needed: --token TOKEN or --token-file FILE (from `python -m "
                     "elastic_mesh.coordinator token create`)")
