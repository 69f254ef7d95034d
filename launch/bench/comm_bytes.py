"""Benchmark: bytes on the wire per inner step, DiLoCo (int8, sparse) against data-parallel fp32 gradient all-reduce.

Both run between the same emulated hosts (launch/wan/harness.py) on the same model size, and the bytes are
counted on the hosts' network interfaces (/proc/net/dev of each namespace), so TCP/IP headers,
coordinator traffic and rendezvous are all included.
- DiLoCo: a real run of `prime.train --join` on every host (debug-shaped model, H inner steps), per
  compression (int8; sparse: diloco.sparse's defaults, the top 64 of every 4096 values in 2 bits).
- Data-parallel: what DDP/FSDP does every step, one Gloo fp32 all_reduce of a gradient-sized tensor.

    python launch/bench/comm_bytes.py [--nodes 2] [--inner-steps 100 500] [--compression int8 sparse] [--dp-steps 5]
    python launch/bench/comm_bytes.py --compression sparse --inner-steps 30 100 --marginal 6
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

from launch.cluster import LocalCluster
from launch.wan.harness import LinkProfile, WanTopology, interface_bytes
import torch

from elastic_mesh import SparseCodec
from prime.config import load_config
from prime.core.model import build_model, count_parameters

MODEL = ["--model.hidden_size", "256", "--model.intermediate_size", "512", "--model.num_layers", "2",
         "--model.num_heads", "4", "--model.num_kv_heads", "2"]

DP_WORKER = """
import datetime, sys, torch, torch.distributed as dist
rank, world, master, numel, steps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
host, port = master.rsplit(':', 1)
store = dist.TCPStore(host, int(port), world, rank == 0, timeout=datetime.timedelta(seconds=120))
options = dist.ProcessGroupGloo._Options(); options._timeout = datetime.timedelta(seconds=300)
options._devices = [dist.ProcessGroupGloo.create_device(interface='wan0')]
pg = dist.ProcessGroupGloo(store, rank, world, options)
grad = torch.randn(numel)
for _ in range(steps):
    pg.allreduce([grad]).wait()
pg.barrier().wait()
del pg  # destroyed while the interpreter is alive: at exit, Gloo's threads abort the process
"""


def sent_bytes(wan: WanTopology, host: str) -> int:
    text = subprocess.run(wan.exec_prefix(host) + ["cat", "/proc/net/dev"], capture_output=True, text=True).stdout
    return interface_bytes(text, wan.interface(), received=False)


def total_sent(wan: WanTopology, hosts: list[str]) -> int:
    return sum(sent_bytes(wan, h) for h in hosts)


def diloco_bytes(wan, hosts, nodes, corpus, inner_steps, compression, rounds=2) -> tuple[int, int]:
    """(bytes sent by all hosts, inner steps per node) of a run of `rounds` outer steps."""
    steps = inner_steps * rounds
    overrides = ["--data.path", str(corpus), "--train.max_steps", str(steps), "--diloco.inner_steps", str(inner_steps),
                 "--diloco.compression", compression,
                 "--train.eval_every", "0", "--checkpoint.every", "0", "--mesh.transfer_timeout_s", "60", *MODEL]
    before = {h: sent_bytes(wan, h) for h in hosts}
    with tempfile.TemporaryDirectory() as run_dir:
        with LocalCluster(Path(run_dir), "configs/debug.toml", overrides, wan=wan,
                          coordinator_args=["--min-wait-s", "30"]) as cluster:
            cluster.run_nodes([f"node{i}" for i in range(nodes)], 1800)
    by_host = {h: sent_bytes(wan, h) - before[h] for h in hosts}
    print(f"  {compression} H={inner_steps}, {rounds} rounds, sent per host: "
          + ", ".join(f"{h} {b / 1e3:.1f} kB" for h, b in by_host.items()), flush=True)
    return sum(by_host.values()), steps


def dp_bytes(wan, nodes, numel, steps) -> int:
    names = [f"node{i}" for i in range(nodes)]
    before = total_sent(wan, names)
    master = f"{wan.address('node0')}:29566"
    procs = [subprocess.Popen(wan.exec_prefix(n) + [sys.executable, "-c", DP_WORKER, str(i), str(nodes), master,
                                                   str(numel), str(steps)]) for i, n in enumerate(names)]
    for p in procs:
        if p.wait(timeout=1800):
            raise RuntimeError("data-parallel worker failed")
    return total_sent(wan, names) - before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="example: python launch/bench/comm_bytes.py --nodes 2 --inner-steps 100 500")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--inner-steps", type=int, nargs="+", default=[100, 500])
    parser.add_argument("--compression", nargs="+", default=["int8"], choices=["int8", "sparse"])
    parser.add_argument("--dp-steps", type=int, default=5)
    parser.add_argument("--marginal", type=int, default=0, metavar="ROUNDS",
                        help="also run ROUNDS outer steps and count only what the rounds past the first 2 send "
                             "(a long run's rate: joining and leaving are paid once)")
    args = parser.parse_args()
    from prime.data.builtin_corpus import prepare

    corpus = prepare()
    hosts = ["coordinator"] + [f"node{i}" for i in range(args.nodes)]
    profile = LinkProfile(latency_ms=1, up_mbit=200, down_mbit=200)
    with WanTopology(hosts, profile) as wan:
        print(wan.describe(), flush=True)
        results = {}
        overrides = dict(zip(MODEL[::2], MODEL[1::2]))
        config = load_config(REPO / "configs/debug.toml", {k.removeprefix("--"): v for k, v in overrides.items()})
        params = count_parameters(build_model(config.model, 0, "meta"))
        for compression in args.compression:
            for h in args.inner_steps:
                sent, steps = diloco_bytes(wan, hosts, args.nodes, corpus, h, compression)
                per_step = sent / steps
                line = (f"DiLoCo H={h}, {compression}: {sent / 1e6:.3f} MB sent by all hosts over {steps} inner steps "
                        f"= {per_step / 1e3:.2f} kB per inner step")
                if args.marginal:
                    # A longer run; the difference is what the extra rounds cost, without joining and leaving.
                    longer, more_steps = diloco_bytes(wan, hosts, args.nodes, corpus, h, compression, args.marginal)
                    per_step = (longer - sent) / (more_steps - steps)
                    line += (f"; {args.marginal} rounds: {longer / 1e6:.3f} MB, the extra rounds "
                             f"{per_step / 1e3:.2f} kB per inner step (joining, leaving and the first rounds: "
                             f"{(sent - per_step * steps) / 1e3:.0f} kB)")
                results[compression, h] = per_step
                print(line, flush=True)
        dp = dp_bytes(wan, args.nodes, params, args.dp_steps) / args.dp_steps
        print(f"data-parallel fp32 all-reduce of {params / 1e6:.2f}M gradients: {dp / 1e6:.2f} MB per step")
        # The ideal: fp32 bytes over the bytes of one node's contribution, per outer step (2 nodes: what each sends).
        sparse_bytes = SparseCodec().encode(torch.randn(params)).numel()
        ideal = {"int8": 4 / (1 + 2 / 64), "sparse": 4 * params / sparse_bytes}
        for (compression, h), per_step in results.items():
            print(f"H={h}: DiLoCo {compression} sends {dp / per_step:.0f}x fewer bytes per inner step than "
                  f"data-parallel (ideal, the payload alone: {ideal[compression] * h:.0f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
