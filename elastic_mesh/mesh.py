"""ElasticDeviceMesh: a node's local group (from torchrun) plus one global Gloo group per local rank.

The local group carries FSDP2 and is fixed for the node's life. The global group of local rank r pairs
shard r of every member node; it is rebuilt only when the coordinator announces a new epoch. Local rank
0 speaks to the coordinator for the node and shares each answer with the other local ranks, as JSON
over the local group (nothing is unpickled).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
from datetime import timedelta
from pathlib import Path
from typing import Callable, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, model_validator

from elastic_mesh.cli import renamed_keys
from elastic_mesh.control.client import (
    CoordinatorClient,
    CoordinatorError,
    Credentials,
    Heartbeat,
    TelemetryBuffer,
)
from elastic_mesh.control.lifeline import LifeLine
from elastic_mesh.control.store import CoordinatorStore
from elastic_mesh.control.tls import MemberIdentity
from elastic_mesh.rounds.plan import RoundClient, RoundPlan
from elastic_mesh.transfer.chunks import Chunked, Deferred, TransferError
from elastic_mesh.transfer.fetcher import ChunkFetcher, FetchReport
from elastic_mesh.transfer.server import ChunkServer
from elastic_mesh.wire.codecs import codec_for
from elastic_mesh.wire.collectives import AllReduceResult, all_reduce_mean
from elastic_mesh.wire.socket_pacing import GroupSockets, NewConnections
from elastic_mesh.wire.topology import LinkEstimates, describe_ring

log = logging.getLogger(__name__)


class MeshConfig(BaseModel):
    """Time-outs of the cross-node groups; one source of truth for every blocking network call."""

    model_config = ConfigDict(extra="forbid")

    transfer_timeout_s: float = Field(30.0, gt=0, description="A collective step that stalls this long fails "
                                      "(a peer that died mid-transfer is noticed by then, usually at once).")
    rendezvous_timeout_s: float = Field(60.0, gt=0, description="Longest wait for peers to form a global group.")
    request_timeout_s: float = Field(30.0, gt=0, description="Timeout of one request to the coordinator.")
    coordinator_retry_s: float = Field(300.0, gt=0, description="How long to keep retrying an unreachable coordinator.")
    barrier_timeout_s: float = Field(3600.0, gt=0, description="Longest wait at a round's barrier.")
    interface: str | None = Field(None, description="Network interface the global groups use (e.g. eth0); "
                                  "None: the address the host name resolves to.")
    server_port: int = Field(0, ge=0, le=65535, description="First port of the transfer servers peers fetch a "
                             "node's state from (local rank r listens on server_port + r); 0: any free port.")
    keep_rounds: int = Field(8, ge=1, description="Committed rounds whose update each node keeps "
                               "for peers that are behind (they replay instead of fetching the whole state).")
    fetch_timeout_s: float = Field(60.0, gt=0, description="Timeout of one chunk request to a peer.")
    streams_per_peer: int = Field(1, ge=1, le=16, description="TCP connections per peer pair for the "
                                  "all-reduce, each carrying a stripe of it at once: one TCP stream on a long, "
                                  "lossy, fast path is capped by loss recovery below the link rate (measured: 4 "
                                  "streams 1.19x faster at 50 Mbit/s, 160 ms, 0.1% loss; 13% slower at 5 Mbit/s). "
                                  "Every node of a run must use the same value.")
    ring_order: Literal["measured", "rank"] = Field("measured", description="Order of the all-reduce's ring: "
                                                    "'measured' picks one whose slowest hop is fast, from the rates "
                                                    "each transfer measures (2.56x faster with one slow route among 4 "
                                                    "nodes); 'rank' keeps the coordinator's rank order. If any node "
                                                    "says 'rank', all use rank order.")
    kernel_pacing: bool = Field(True, description="A paced all-reduce (the trainer's pace) also has the kernel "
                                "pace its TCP connections (SO_MAX_PACING_RATE, Linux), so bytes leave evenly "
                                "within each piece and after a loss (worst second of one paced all-reduce at "
                                "0.1% loss: 1.29x the average, 1.38x with the token bucket alone). Off: the "
                                "token bucket alone.")
    chunk_bytes: int = Field(4 << 20, ge=4096, le=1 << 30, description="Bytes per chunk of what a node serves, the "
                                      "unit a joiner verifies and spreads over its sources (smaller: more sources "
                                      "share a small model's state; larger: fewer requests).")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: object) -> object:
        return renamed_keys(data, MESH_RENAMES, "mesh")


MESH_RENAMES = {"snapshot_port": "server_port", "snapshot_keep": "keep_rounds", "snapshot_chunk_bytes": "chunk_bytes"}


def node_hash(local_digest: bytes, group: dist.ProcessGroup | None = None) -> str:
    """One hash for the node from every local rank's digest of its shard (a collective of the local group)."""
    mine = torch.frombuffer(bytearray(local_digest.ljust(32, b"\0")[:32]), dtype=torch.uint8)
    world = dist.get_world_size()
    gathered = [torch.empty(32, dtype=torch.uint8) for _ in range(world)]
    if world > 1:
        dist.all_gather(gathered, mine, group=group)
    else:
        gathered = [mine]
    return hashlib.blake2b(b"".join(g.numpy().tobytes() for g in gathered), digest_size=8).hexdigest()


class ElasticDeviceMesh:
    def __init__(self, config: MeshConfig, token: str, node_facts: dict, serves: dict[str, int]) -> None:
        """serves: the kinds of state this node serves its peers, and how many versions of each it keeps."""
        if not dist.is_initialized():
            raise RuntimeError("initialise the node's local process group before the mesh (torchrun or a 1-rank group)")
        self.config, self.token, self.node_facts = config, token, node_facts
        self.local_rank, self.local_world = dist.get_rank(), dist.get_world_size()
        self.client = CoordinatorClient.for_token(token, config.request_timeout_s, config.coordinator_retry_s)
        # When the run speaks TLS, each local rank's server gets a certificate for its own key at join.
        self.identity = MemberIdentity() if self.client.tls_fp else None
        self._owner = self  # whose membership (join answer, heartbeat) this is; a background view reads its owner's
        self.heartbeat: Heartbeat | None = None
        self.lifeline: LifeLine | None = None  # held by local rank 0: its close tells the coordinator we died
        self.telemetry = TelemetryBuffer()
        self._groups: dict[int, list[dist.ProcessGroup]] = {}
        self._sockets: dict[int, list[GroupSockets | None]] = {}
        # Link rates this local rank measured, kept across epochs (keyed by node name): the next ring's input.
        self.links = LinkEstimates()
        self._local_group: dist.ProcessGroup | None = None  # None: the default (local) group
        # Every local rank serves its own part of the state; the key arrives with the join answer.
        port = config.server_port + self.local_rank if config.server_port else 0
        self.server = ChunkServer("0.0.0.0", port, key="", keep=serves)
        self.node_facts = {**node_facts, "server_ports": self.gather(self.server.port)}
        if self.identity is not None:
            self.node_facts["tls_public_keys"] = self.gather(self.identity.public_pem)
        self.rounds = RoundClient(self.client, self._leader_call, config.barrier_timeout_s)
        self._joined = self._join()

    @property
    def joined(self) -> dict:
        """The coordinator's answer to this node's (latest) join: session, name, run id, committed round."""
        return self._owner._joined

    # ---- talking to the coordinator (local rank 0), shared with the node ------------------------------
    def _join(self) -> dict:
        answer = None
        if self.local_rank == 0:
            try:
                answer = self.client.join(self.token, procs_per_node=self.local_world, **self.node_facts)
            except CoordinatorError as e:
                answer = {"error": str(e)}
        answer = self.share(answer)
        if "error" in answer:
            raise CoordinatorError(f"the coordinator refused this node: {answer['error']}")
        self.client.credentials = Credentials(self.client.address, answer["node_id"], answer["session"], answer["name"])
        self.server.key = answer["transfer_key"]
        if self.identity is not None:
            self.server.tls = self.identity.server_context(answer["tls_certs"][self.local_rank])
        if self.local_rank == 0:
            if self.heartbeat:
                self.heartbeat.stop()
            if self.lifeline:  # an older session's (a rejoin): the coordinator already counts it gone
                self.lifeline.stop()
            self.heartbeat = Heartbeat(self.client, answer["heartbeat_s"], self.telemetry).start()
            self.lifeline = LifeLine(self.client.address, answer["node_id"], answer["session"],
                                     self.config.request_timeout_s, self.client.tls_context()).start()
        return answer

    def share(self, value: dict | None) -> dict:
        """Local rank 0's value on every local rank (JSON over the local group)."""
        if self.local_world == 1:
            return value
        data = json.dumps(value).encode() if self.local_rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self._local_group)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.local_rank == 0 else torch.empty(
            int(size), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self._local_group)
        return json.loads(buf.numpy().tobytes().decode())

    def gather(self, value: object) -> list:
        """Every local rank's JSON value, in local-rank order, on every local rank."""
        if self.local_world == 1:
            return [value]
        data = json.dumps(value).encode()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.local_world)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self._local_group)
        longest = int(max(s.item() for s in sizes))
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # JSON is never empty
        bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.local_world)]
        dist.all_gather(bufs, mine, group=self._local_group)
        return [json.loads(b[:int(n.item())].numpy().tobytes().decode()) for b, n in zip(bufs, sizes)]

    def background_view(self) -> "ElasticDeviceMesh":
        """The same mesh whose local agreements and coordinator calls run over a second local Gloo group,
        for one background thread (a round in flight while the caller computes): two threads must
        never interleave collectives on one group. Collective: every local rank calls it, in the same order."""
        view = copy.copy(self)
        view._owner = self  # a rejoin replaces the owner's session and heartbeat: the view sees the new ones
        view._local_group = dist.new_group(backend="gloo") if self.local_world > 1 else None
        view.rounds = RoundClient(self.client, view._leader_call, self.config.barrier_timeout_s)
        return view

    def node_hash(self, local_digest: bytes) -> str:
        """node_hash over this mesh's local group."""
        return node_hash(local_digest, self._local_group)

    def _leader_call(self, call) -> dict:
        answer = None
        if self.local_rank == 0:
            try:
                answer = call()
            except CoordinatorError as e:
                answer = {"error": str(e), "status_code": e.status}
        answer = self.share(answer)
        if "error" in answer:
            raise CoordinatorError(answer["error"], answer.get("status_code"))
        return answer

    def publish(self, record: dict) -> None:
        """Sends a metrics record to the coordinator's dashboard with the next heartbeat (local rank 0 only)."""
        if self.local_rank == 0:
            self.telemetry.add(record)

    @property
    def name(self) -> str:
        return self.joined["name"]

    def lease(self, kind: str, worker: int, held: list[int], spare: bool = False) -> dict | None:
        """A work item of `kind` for one worker (called by that local rank itself, mid-round, without the
        others); `held`: the items it holds already; `spare`: one more to consume beside those, which the
        coordinator grants up to a fair share (else the answer's item is None). None when the coordinator
        has dropped this node: the round will be discarded anyway."""
        try:
            return self.client.post("/v1/lease", {"kind": kind, "worker": worker, "held": held, "spare": bool(spare)})
        except CoordinatorError as e:
            if e.dropped:
                return None
            raise

    def rejoin(self) -> dict:
        """After the coordinator dropped this node (declared dead, e.g. after a partition)."""
        self._joined = self._join()
        return self._joined

    # ---- catching up: state from peers' transfer servers ---------------------------------------------
    def fetch(self, sources: dict, kind: str, version: int | None, work_dir: Path,
              mixed: bool = False) -> tuple[dict, dict, FetchReport]:
        """This local rank's part of `kind` at `version` from every source's server for the same local rank
        (mixed: state that differs between nodes, see ChunkFetcher.fetch)."""
        addresses = [s["servers"][self.local_rank] for s in sources["sources"] if len(s["servers"]) > self.local_rank]
        if not addresses:
            raise TransferError(f"no live node holds round {sources['committed_round']} to fetch from; if all "
                                "the nodes that had it are gone, restart the run from a checkpoint (--resume)")
        fetcher = ChunkFetcher(addresses, self.server.key, work_dir, timeout_s=self.config.fetch_timeout_s,
                               tls=self.client.tls_context())
        manifest, tensors, report = fetcher.fetch(kind, version, mixed)
        problems = [f"{len(found)} {what} ({'; '.join(found[:3])}{'; ...' if len(found) > 3 else ''})"
                    for found, what in ((report.corrupt, "chunk(s) did not match their hash"),
                                        (report.failed, "request(s) failed")) if found]
        if problems:
            log.warning("%s %d: %s; all taken from other sources", kind, report.version, ", ".join(problems))
        return manifest, tensors, report

    @property
    def dropped(self) -> bool:
        heartbeat = self._owner.heartbeat
        lost = self.local_rank == 0 and heartbeat is not None and heartbeat.lost is not None
        return bool(self.share({"lost": lost})["lost"])

    # ---- the global group of this local rank -------------------------------------------------------
    def group(self, plan: RoundPlan) -> list[dist.ProcessGroup]:
        """This local rank's global group(s) for the plan's epoch: streams_per_peer groups over the same
        members, each with its own TCP connection per peer pair (made once per epoch)."""
        groups = self._groups.get(plan.epoch)
        if groups is None:
            for stale in list(self._groups):
                self.drop_group(stale)
            watch = NewConnections()  # before the device: its listener is not a server this process ran
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timedelta(seconds=self.config.transfer_timeout_s)
            options._devices = [dist.ProcessGroupGloo.create_device(interface=self.config.interface)
                                if self.config.interface else dist.ProcessGroupGloo.create_default_device()]
            groups, sockets = [], []
            coordinator_port = int(self.client.address.rsplit(":", 1)[1])
            for stream in range(self.config.streams_per_peer):
                prefix = f"e{plan.epoch}/r{self.local_rank}/" + (f"s{stream}/" if stream else "")
                store = CoordinatorStore(self.client, prefix, self.config.rendezvous_timeout_s)
                groups.append(dist.ProcessGroupGloo(store, plan.rank, plan.world_size, options))
                sockets.append(watch.since(peers=plan.world_size - 1, avoid_ports={coordinator_port}))
            self._groups[plan.epoch], self._sockets[plan.epoch] = groups, sockets
            log.debug("global group of local rank %d for epoch %d: rank %d of %d, %d stream(s) per peer",
                      self.local_rank, plan.epoch, plan.rank, plan.world_size, len(groups))
        return groups

    def serve(self, kind: str, version: int, tensors: dict[str, torch.Tensor], meta: dict | None = None,
              transform: Callable[[Chunked], Chunked] | None = None) -> None:
        """Serves `tensors` to peers as `version` of `kind` (one of the kinds this node serves), laid out
        and hashed when a peer first asks (transfer/chunks.py's Deferred: copies that nothing writes
        again). transform: rewrites the laid-out bytes once (where a fault injector corrupts them)."""
        self.server.publish(Deferred(version, tensors, meta, self.config.chunk_bytes, transform), kind)

    def all_reduce(self, plan: RoundPlan, x: torch.Tensor, compression: str, *, valid: bool = True,
                   outlier_factor: float = math.inf, on_phase: Callable[[str], None] | None = None,
                   spread_s: float | None = None, finish_s: float | None = None) -> AllReduceResult:
        """The mean of `x` over the plan's contributors, on this local rank's global group(s), compressed
        with `compression` (wire/codecs.py); the ring follows the measured links (mesh.ring_order) and a
        paced one has the kernel pace its sockets too (mesh.kernel_pacing). See
        wire/collectives.all_reduce_mean for valid, outlier_factor, on_phase, spread_s and finish_s.
        Raises CollectiveError (a RuntimeError) when a peer dies, stalls or sends bad data."""
        names = [m["name"] for m in plan.members]
        result = all_reduce_mean(self.group(plan), x, codec_for(compression), plan.contributes, valid=valid,
                                 outlier_factor=outlier_factor, on_phase=on_phase, peers=names,
                                 links=self.links if self.config.ring_order == "measured" else None,
                                 spread_s=spread_s, finish_s=finish_s,
                                 sockets=self.group_sockets(plan.epoch) if self.config.kernel_pacing else None)
        if result.ring_changed and self.local_rank == 0:
            log.info("%s: the all-reduce ring is now %s", self.name, describe_ring(result.ring, result.rates, names))
        return result

    def group_sockets(self, epoch: int) -> list[GroupSockets | None]:
        """The TCP connections of each of the epoch's groups, where they could be found (for kernel pacing)."""
        return self._sockets.get(epoch, [])

    def drop_group(self, epoch: int) -> None:
        # A Gloo group that saw a failure cannot be reused; its peers may be gone.
        self._groups.pop(epoch, None)
        self._sockets.pop(epoch, None)

    def agree(self, ok: bool) -> bool:
        """True only if every local rank says ok (before anything is applied)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        if self.local_world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._local_group)
        return bool(flag.item())

    def close(self, leave: bool = True) -> None:
        if self.local_rank == 0:
            if self.heartbeat:
                self.heartbeat.stop()
            if leave and self.client.credentials:
                try:
                    self.client.post("/v1/leave", {}, retry=False)
                except CoordinatorError:
                    pass  # the coordinator will notice the missing heartbeats instead
            if self.lifeline:  # after the leave, so this close does not read as a death
                self.lifeline.stop()
        self._groups.clear()
        self._sockets.clear()
        self.server.stop()
