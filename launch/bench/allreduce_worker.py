"""One member of the all-reduce benchmark (started inside a WAN namespace by launch/bench/allreduce.py)."""

from __future__ import annotations

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist

from elastic_mesh.wire.codecs import codec_for
from elastic_mesh.wire.sparse import SparseCodec
from elastic_mesh.wire.collectives import all_reduce_mean
from elastic_mesh.wire.topology import LinkEstimates


def main() -> None:
    rank, world, master, mb, repeats, interface = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                                   float(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    settings = json.loads(sys.argv[7]) if len(sys.argv) > 7 else {}
    streams, with_fp32 = settings.get("streams", [1]), settings.get("fp32", True)
    # "fixed": the ring in rank order; "measured": the ring chosen from link rates measured by the
    # all-reduces themselves (kept across repeats, as a node keeps them across outer steps).
    rings = settings.get("rings", ["fixed"])
    links = LinkEstimates()
    torch.set_num_threads(1)
    host, port = master.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), world, rank == 0, timeout=datetime.timedelta(seconds=300))
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=600)
    options._devices = [dist.ProcessGroupGloo.create_device(interface=interface)]
    # One group per stream: each is one more TCP connection per peer pair (as mesh.streams_per_peer).
    groups = [dist.ProcessGroupGloo(dist.PrefixStore(f"s{i}/", store) if i else store, rank, world, options)
              for i in range(max(streams))]
    pg = groups[0]
    n = int(mb * 1e6 / 4)
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    names = (["gloo_fp32"] if with_fp32 else []) + [f"prime_int8_{ring}_x{s}" for ring in rings for s in streams]
    sparse = SparseCodec.from_name(settings["sparse"]) if settings.get("sparse") else None
    names += ["prime_sparse_fixed_x1"] if sparse else []
    results = {name: [] for name in names}
    results["int8_bytes_sent"] = 0
    pg.barrier().wait()
    for _ in range(repeats):
        for name in names:
            pg.barrier().wait()
            started = time.perf_counter()
            if name == "gloo_fp32":
                y = x.clone()
                pg.allreduce([y]).wait()
            elif name == "prime_sparse_fixed_x1":  # encoding and decoding included: they are the exchange's
                sparse_result = all_reduce_mean(pg, x, sparse, [True] * world)
                results["sparse_bytes_sent"] = sparse_result.bytes_sent
            else:
                marks = {}
                count = int(name.rsplit("x", 1)[1])
                measured = "_measured_" in name
                result = all_reduce_mean(groups[:count], x, codec_for("int8"), [True] * world,
                                         on_phase=lambda p: marks.__setitem__(p, time.perf_counter() - started),
                                         links=links if measured else None)
                results.setdefault("phases", []).append(marks)
                results.setdefault(f"{name}_rings", []).append(result.ring)
                if measured:
                    results["rates"] = result.rates
                results["int8_bytes_sent"] = result.bytes_sent
            results[name].append(time.perf_counter() - started)
    if rank == 0:
        exact = sum(torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(world)) / world
        results["int8_error"] = ((result.mean - exact).norm() / exact.norm()).item()
        if sparse:
            results["sparse_cosine"] = float(sparse_result.mean @ exact / (sparse_result.mean.norm() * exact.norm()))
        print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
