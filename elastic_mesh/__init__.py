"""elastic_mesh: fault-tolerant communication between processes that come and go.

It moves tensors and bytes between members in numbered rounds and versions; it must never import
`prime` or know about models, optimizers or data formats, so that another trainer can use it.

What a user of the library needs is named here (tests/unit/test_boundaries.py holds prime to these
names); the submodules are its insides. Names are imported when first used, so a small command pays
for nothing it does not touch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# name -> the module that defines it
_PUBLIC = {
    # a node's place in a run: the local group, a global group per local rank, rounds, data leases
    "ElasticDeviceMesh": "elastic_mesh.mesh",
    "MeshConfig": "elastic_mesh.mesh",
    "node_hash": "elastic_mesh.mesh",
    # the round's collective, and what it moves
    "all_reduce_mean": "elastic_mesh.wire.collectives",
    "AllReduceResult": "elastic_mesh.wire.collectives",
    "codec_for": "elastic_mesh.wire.codecs",
    # talking to the coordinator, and the errors of the library
    "CoordinatorClient": "elastic_mesh.control.client",
    "CoordinatorError": "elastic_mesh.control.client",
    "TransferError": "elastic_mesh.transfer.chunks",
    "read_token": "elastic_mesh.control.token",
    # versions published to many members (a swarm), and what one carries
    "BroadcastMember": "elastic_mesh.broadcast.member",
    "BroadcastSettings": "elastic_mesh.broadcast.member",
    "BroadcastError": "elastic_mesh.broadcast.member",
    "Deferred": "elastic_mesh.transfer.chunks",
    "payload": "elastic_mesh.broadcast.payload",
    # serving a run's members beside the coordinator
    "JsonServer": "elastic_mesh.control.http",
    "TokenCheck": "elastic_mesh.control.http",
    "Refused": "elastic_mesh.control.http",
    # the command line every entry point speaks
    "CommandLine": "elastic_mesh.cli",
    "Flag": "elastic_mesh.cli",
    "Positional": "elastic_mesh.cli",
    "ConfigError": "elastic_mesh.cli",
    "load_config_file": "elastic_mesh.cli",
    "path_exists": "elastic_mesh.cli",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic_mesh' has no attribute {name!r}")
    value = importlib.import_module(module)
    value = value if name == module.rsplit(".", 1)[-1] else getattr(value, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # what the names are, for readers and type checkers
    from elastic_mesh.broadcast import payload
    from elastic_mesh.broadcast.member import BroadcastError, BroadcastMember, BroadcastSettings
    from elastic_mesh.cli import CommandLine, ConfigError, Flag, Positional, load_config_file, path_exists
    from elastic_mesh.control.client import CoordinatorClient, CoordinatorError
    from elastic_mesh.control.http import JsonServer, Refused, TokenCheck
    from elastic_mesh.control.token import read_token
    from elastic_mesh.mesh import ElasticDeviceMesh, MeshConfig, node_hash
    from elastic_mesh.transfer.chunks import Deferred, TransferError
    from elastic_mesh.wire.codecs import codec_for
    from elastic_mesh.wire.collectives import AllReduceResult, all_reduce_mean
