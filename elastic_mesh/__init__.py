"""elastic_mesh: fault-tolerant communication between processes that come and go.

It moves tensors and bytes between members in numbered rounds and versions; it must never import
`prime` or know about models, optimizers or data formats, so that another trainer can use it.

What a user of the library needs is named here, grouped by concern (tests/unit/test_boundaries.py
holds prime to these names); the submodules are its insides. Names are imported when first used, so
a small command pays for nothing it does not touch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# name -> the module that defines it
_PUBLIC = {
    # a node's place in a run: local group, a global group per local rank, rounds, leases, serving peers
    "ElasticDeviceMesh": "elastic_mesh.mesh",
    "MeshConfig": "elastic_mesh.mesh",
    "node_hash": "elastic_mesh.mesh",
    "RoundPlan": "elastic_mesh.rounds.plan",
    "AllReduceResult": "elastic_mesh.wire.collectives",
    "decode_wire": "elastic_mesh.wire.collectives",
    "SparseCodec": "elastic_mesh.wire.sparse",
    "Chunked": "elastic_mesh.transfer.chunks",
    # the coordinator: its client, its settings and ledgers, and the errors of the library
    "CoordinatorClient": "elastic_mesh.control.client",
    "CoordinatorError": "elastic_mesh.control.client",
    "TransferError": "elastic_mesh.transfer.chunks",
    "read_token": "elastic_mesh.control.token",
    "JoinToken": "elastic_mesh.control.token",
    "CoordinatorConfig": "elastic_mesh.coordinator.config",
    "WorkLedger": "elastic_mesh.coordinator.leases",
    # versions published to many members (a swarm), and what one carries
    "BroadcastMember": "elastic_mesh.broadcast.member",
    "BroadcastSettings": "elastic_mesh.broadcast.member",
    "BroadcastError": "elastic_mesh.broadcast.member",
    "ChunkDir": "elastic_mesh.transfer.chunk_dir",
    "payload": "elastic_mesh.broadcast.payload",
    # services beside the coordinator: token-checked JSON over HTTP, and the dashboard's shared assets
    "JsonServer": "elastic_mesh.control.http",
    "TokenCheck": "elastic_mesh.control.http",
    "Refused": "elastic_mesh.control.http",
    "Route": "elastic_mesh.control.http",
    "ServiceLimits": "elastic_mesh.control.service",
    "printable": "elastic_mesh.control.service",
    "DASHBOARD_DIR": "elastic_mesh.coordinator.server",
    # the one command-line dialect of every entry point
    "CommandLine": "elastic_mesh.cli",
    "Flag": "elastic_mesh.cli",
    "Positional": "elastic_mesh.cli",
    "ConfigError": "elastic_mesh.cli",
    "load_config_file": "elastic_mesh.cli",
    # processes
    "kill_tree": "elastic_mesh.control.process_tree",
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
    from elastic_mesh.cli import CommandLine, ConfigError, Flag, Positional, load_config_file
    from elastic_mesh.control.client import CoordinatorClient, CoordinatorError
    from elastic_mesh.control.http import JsonServer, Refused, Route, TokenCheck
    from elastic_mesh.control.service import ServiceLimits, printable
    from elastic_mesh.control.process_tree import kill_tree
    from elastic_mesh.control.token import JoinToken, read_token
    from elastic_mesh.coordinator.config import CoordinatorConfig
    from elastic_mesh.coordinator.leases import WorkLedger
    from elastic_mesh.coordinator.server import DASHBOARD_DIR
    from elastic_mesh.mesh import ElasticDeviceMesh, MeshConfig, node_hash
    from elastic_mesh.rounds.plan import RoundPlan
    from elastic_mesh.transfer.chunk_dir import ChunkDir
    from elastic_mesh.transfer.chunks import Chunked, TransferError
    from elastic_mesh.wire.collectives import AllReduceResult, decode_wire
    from elastic_mesh.wire.sparse import SparseCodec
