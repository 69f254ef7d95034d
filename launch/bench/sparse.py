"""Benchmark: sparse pseudo-gradients (diloco.compression = sparse) against int8, side by side: bytes, loss,
exchange time, and the encoding's cost.

Each measure is taken by the benchmark that owns it, at the settings recommended here:
- bytes per inner step against fp32 data-parallel at H (comm_bytes.py --marginal 6: real runs, counted on
  the emulated hosts' interfaces, control traffic included, over rounds 3-6: a long run's rate);
- eval loss at equal tokens against int8 DiLoCo and data-parallel, M=2 (H=10) and M=4 (H=5), over the
  seeds (loss_parity.py; arms already in --results are not run again);
- the exchange's wall time against int8's under the `global` WAN profile, 3 members, a tensor of
  cpu-demo's size (allreduce.py --sparse: encoding and decoding inside the timed exchange);
- the codec's own time (encode, then decode every member's contribution and average them) on 2 threads,
  against the H inner steps it follows, on cpu-demo's model.
Ends with the line
`sparse: bytes <R>x fp32 DDP at H=<H>, loss <L> x int8 DiLoCo (M=<M>), exchange <X> x int8's`
(loss: the mean over the seeds at M=4).

    python launch/bench/sparse.py [--seeds 0,1,2] [--results runs/sparse-parity.jsonl] [--skip bytes,loss,exchange]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

import torch

from elastic_mesh import SparseCodec
from prime.config import load_config
from prime.core.model import build_model

# The recommended settings (docs/benchmarks.md, "Sparse pseudo-gradients"): SparseLoCo's codec (64 of 4096, 2 bits,
# error decay 0.95, no outer momentum) with the outer lr tuned on cpu-demo (M=2, H=10, seed 0, 150 steps): 0.7 2.543,
# 1.0 2.393, 1.5 2.336, 2.0 2.267, 3.0 2.200, 4.0 2.416 (int8 at 0.7: 2.244). A run this short (15 outer steps) sends
# ~1.6 % of each pseudo-gradient and lets little of the residual out: a larger step makes up for it.
SPARSE_ARM = {"compression": "sparse", "outer_lr": 3.0, "outer_momentum": 0.0}
INT8_ARM = {"outer_lr": 0.7, "outer_momentum": 0.0}  # cpu-demo's tuned int8 DiLoCo
LOSS_SETTINGS = {2: 10, 4: 5}  # M -> H, as loss_parity's int8 figures were measured
BYTES_H = (30, 100)


def run(cmd: list[str]) -> str:
    print("$", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    print(done.stdout[-3000:], flush=True)
    if done.returncode:
        raise SystemExit(f"{cmd[1]} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def measure_bytes() -> dict[int, float]:
    out = run([sys.executable, "launch/bench/comm_bytes.py", "--compression", "sparse", "--marginal", "6",
               "--inner-steps", *map(str, BYTES_H)])
    return {int(h): float(r) for h, r in re.findall(r"H=(\d+): DiLoCo sparse sends (\d+)x fewer", out)}


def _arm(nodes: int, seed: int, extra: dict) -> dict:
    return {"kind": "diloco", "nodes": nodes, "seed": seed, "batch_mult": 1, "inner_steps": LOSS_SETTINGS[nodes],
            "warmup": 50, **extra}


def measure_loss(seeds: list[int], results: Path) -> dict[int, dict[str, float]]:
    """M -> {sparse, int8, data-parallel: mean eval loss over the seeds}."""
    for nodes, h in LOSS_SETTINGS.items():
        for compression, arm in (("sparse", SPARSE_ARM), ("int8", INT8_ARM)):
            run([sys.executable, "launch/bench/loss_parity.py", "--nodes", str(nodes), "--inner-steps", str(h),
                 "--outer-lr", str(arm["outer_lr"]), "--outer-momentum", str(arm["outer_momentum"]),
                 "--compression", compression, "--seeds", ",".join(map(str, seeds)), "--results", str(results)])
    done = {json.dumps(r["arm"], sort_keys=True): r["eval_loss"] for r in map(json.loads, results.open())}
    out = {}
    for nodes in LOSS_SETTINGS:
        def mean(arm_of) -> float:
            return statistics.fmean(done[json.dumps(arm_of(seed), sort_keys=True)] for seed in seeds)
        out[nodes] = {"sparse": mean(lambda s: _arm(nodes, s, SPARSE_ARM)),
                      "int8": mean(lambda s: _arm(nodes, s, INT8_ARM)),
                      "data-parallel": mean(lambda s: {"kind": "data-parallel", "nodes": nodes, "seed": s,
                                                       "batch_mult": 1, "warmup": 50})}
    return out


def measure_exchange() -> float:
    params = _cpu_demo_parameters()
    out = run([sys.executable, "launch/bench/allreduce.py", "--profile", "global", "--nodes", "3",
               "--mb", f"{params * 4 / 1e6:.3f}", "--sparse", "--no-fp32", "--repeats", "2"])
    return float(re.search(r"sparse exchange / int8 all-reduce: ([\d.]+)x", out)[1])


def _cpu_demo_parameters() -> int:
    model = build_model(load_config(REPO / "configs/cpu-demo.toml").model, 0, "meta")
    return sum(p.numel() for p in model.parameters())


def measure_codec_cost(nodes: int = 4, inner_steps: int = 30) -> tuple[float, float, float]:
    """(codec seconds per outer step, inner step seconds, fraction of H inner steps) on 2 threads, cpu-demo:
    a member encodes its pseudo-gradient, then decodes every member's contribution and averages them."""
    torch.set_num_threads(2)
    config = load_config(REPO / "configs/cpu-demo.toml")
    model = build_model(config.model, 0)
    start = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.optim.lr)
    tokens = torch.randint(0, config.model.vocab_size, (config.train.batch_size, config.train.seq_len + 1))
    times = []
    for _ in range(6):
        began = time.perf_counter()
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - began)
    step_s = statistics.median(times[1:])
    pseudo = torch.cat([(s - p.detach()).reshape(-1) for s, p in zip(start, model.parameters())])
    codec = SparseCodec()
    codec_s = []
    for _ in range(3):
        began = time.perf_counter()
        encoded = codec.encode(pseudo)
        parts = [codec.decode(encoded, pseudo.numel()) for _ in range(nodes)]
        total = torch.zeros_like(parts[0])
        for part in parts:
            total += part
        codec_s.append(time.perf_counter() - began)
    seconds = min(codec_s)
    return seconds, step_s, seconds / (inner_steps * step_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--results", type=Path, default=REPO / "runs/sparse-parity.jsonl",
                        help="loss_parity's results (JSONL): arms found there are not run again")
    parser.add_argument("--skip", default="", help="comma-separated: bytes, loss, exchange (reported as n/a)")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    seeds = [int(s) for s in args.seeds.split(",")]
    codec_s, step_s, fraction = measure_codec_cost()
    print(f"codec: {codec_s * 1e3:.0f} ms per outer step (encode, decode 4 contributions, average; 2 threads) "
          f"against {step_s:.2f} s per inner step: {fraction * 100:.2f}% of H=30 inner steps", flush=True)
    ratios = measure_bytes() if "bytes" not in skip else {}
    losses = measure_loss(seeds, args.results) if "loss" not in skip else {}
    for nodes, row in losses.items():
        print(f"M={nodes}, H={LOSS_SETTINGS[nodes]}, {len(seeds)} seeds: sparse {row['sparse']:.4f}, int8 DiLoCo "
              f"{row['int8']:.4f}, data-parallel {row['data-parallel']:.4f}: sparse {row['sparse'] / row['int8']:.4f}x "
              f"int8, {row['sparse'] / row['data-parallel']:.4f}x data-parallel")
    exchange = measure_exchange() if "exchange" not in skip else None
    for h, r in sorted(ratios.items()):
        print(f"bytes per inner step at H={h}: {r:.0f}x fewer than fp32 data-parallel")
    h = min(ratios) if ratios else BYTES_H[0]
    loss = f"{losses[4]['sparse'] / losses[4]['int8']:.3f}" if 4 in losses else "n/a"
    print(f"sparse: bytes {ratios.get(h, float('nan')):.0f}x fp32 DDP at H={h}, loss {loss} x int8 DiLoCo (M=4), "
          f"exchange {exchange if exchange is not None else float('nan'):.3f} x int8's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
