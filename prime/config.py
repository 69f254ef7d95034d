"""The job's configuration: one node's pretraining (PretrainConfig) plus what makes it one DiLoCo
replica of a multi-node run (diloco, mesh). Composed here, at the top, so that the trainer knows only
its own sections and the outer loop only its own; parsed by elastic_mesh's one command-line dialect
(a TOML file, then dotted `--section.key VALUE` overrides), validated before anything starts.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from elastic_mesh import ConfigError, MeshConfig, load_config_file
from prime.diloco.config import DilocoConfig
from prime.pretrain.config import PretrainConfig

__all__ = ["ConfigError", "JobConfig", "load_config"]


class JobConfig(PretrainConfig):
    """A node's whole job: its pretraining sections, then the outer loop's and the mesh's."""

    diloco: DilocoConfig = Field(default_factory=DilocoConfig)
    mesh: MeshConfig = Field(default_factory=MeshConfig)


def load_config(path: str | Path | None, overrides: dict[str, str] | None = None) -> JobConfig:
    """Reads a TOML file (or the defaults), applies dotted overrides, validates everything."""
    return load_config_file(JobConfig, path, overrides)
