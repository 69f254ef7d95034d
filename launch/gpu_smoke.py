"""GPU smoke test: the CUDA path end to end on one GPU, in about 5 minutes, in three independent parts.

- codec:  the int8 and bf16 wire codecs on CUDA tensors: encode+decode throughput, error, and whether
          a GPU and a CPU member turn the same values into the same bytes and floats (they must: every
          member decodes the all-reduce to the same model).
- train:  `prime.train` under torchrun (NCCL local group), FSDP2 applied even to the single rank, bf16
          compute, activation checkpointing, on the built-in corpus; tokens/s and MFU from metrics.jsonl.
- diloco: `launch/local.py` with two DiLoCo nodes sharing the GPU (each its own torchrun and NCCL
          group, the global Gloo group and int8 all-reduce between them); passes when every node's model
          is bit-identical after every committed outer step.

Each part prints one line; a failing part does not stop the others. `--out FILE` writes them as JSON.
Cannot run without a GPU.

    python launch/gpu_smoke.py [--parts codec,train,diloco] [--steps 200] [--run-dir runs/gpu-smoke] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# ~60M parameters: big enough to load the GPU, small enough for a few hundred steps in minutes.
TRAIN_OVERRIDES = {
    "name": "gpu-smoke", "model.hidden_size": "768", "model.intermediate_size": "2048", "model.num_layers": "8",
    "model.num_heads": "12", "model.num_kv_heads": "4", "model.max_position_embeddings": "1024",
    "train.seq_len": "1024", "train.batch_size": "32", "train.micro_batch_size": "16", "train.device": "cuda",
    "train.precision": "bf16", "train.shard_single_rank": "true", "train.activation_checkpointing": "true",
    "train.eval_every": "100", "checkpoint.every": "0", "optim.lr": "1e-3", "optim.warmup_steps": "30",
}
DILOCO_OVERRIDES = {"train.device": "cuda", "train.precision": "bf16", "train.max_steps": "100",
                    "diloco.inner_steps": "25", "checkpoint.every": "0"}


def _flags(overrides: dict[str, str]) -> list[str]:
    return [x for k, v in overrides.items() for x in (f"--{k}", v)]


def _env() -> dict[str, str]:
    env = {**os.environ, "PRIME_PLAIN_LOGS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


def part_codec() -> dict:
    import torch

    from elastic_mesh.wire.codecs import codec_for

    n = 1 << 26  # 64M values, 256 MB of fp32: a 64M-parameter model's pseudo-gradient
    torch.manual_seed(0)
    cpu_values = torch.randn(n) * 1e-3
    values = cpu_values.cuda()
    result: dict = {"values": n}
    for name in ("int8", "bf16"):
        codec = codec_for(name)
        encoded = codec.encode(values.clone())
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            codec.decode(codec.encode(values.clone()), n)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        decoded = codec.decode(encoded, n)
        error = ((decoded - values).norm() / values.norm()).item()
        cpu_encoded = codec.encode(cpu_values.clone())
        same_bytes = torch.equal(encoded.cpu(), cpu_encoded)
        same_floats = torch.equal(codec.decode(cpu_encoded.cuda(), n).cpu(), codec.decode(cpu_encoded, n))
        result[name] = {"encode_decode_gb_s": round(4 * n / statistics.median(times) / 1e9, 1),
                        "relative_error": round(error, 5), "bytes_same_as_cpu": same_bytes,
                        "decode_same_as_cpu": same_floats}
    ok = all(result[c]["decode_same_as_cpu"] for c in ("int8", "bf16"))
    line = "codec: " + "; ".join(
        f"{c} {result[c]['encode_decode_gb_s']} GB/s fp32 in, error {result[c]['relative_error'] * 100:.2f}%, "
        f"bytes same as CPU {result[c]['bytes_same_as_cpu']}, decode same as CPU {result[c]['decode_same_as_cpu']}"
        for c in ("int8", "bf16"))
    return {"ok": ok, "line": line, **result}


def part_train(steps: int, run_dir: Path) -> dict:
    import torch

    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "1", "-m", "prime.train",
           "--config", "configs/cpu-demo.toml", "--run-dir", str(run_dir), "--quiet",
           *_flags({**TRAIN_OVERRIDES, "train.max_steps": str(steps)})]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=_env())
    if proc.returncode:
        return {"ok": False, "line": f"train: prime.train exited {proc.returncode}"}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_seen = [r for r in records if "loss" in r][10:]  # skip warm-up
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    tokens_s = statistics.median(r["tokens_per_s"] for r in steps_seen)
    mfus = [r["mfu"] for r in steps_seen if r.get("mfu") is not None]
    mfu = statistics.median(mfus) if mfus else float("nan")
    line = (f"train on {torch.cuda.get_device_name(0)}: {len(steps_seen) + 10} steps in "
            f"{time.monotonic() - started:.0f} s, median {tokens_s:.0f} tokens/s, MFU {mfu:.3f}, "
            f"loss {steps_seen[0]['loss']:.3f} -> {steps_seen[-1]['loss']:.3f}, eval {evals[0]:.3f} -> {evals[-1]:.3f}")
    ok = steps_seen[-1]["loss"] < steps_seen[0]["loss"]
    return {"ok": ok, "line": line, "tokens_per_s": tokens_s, "mfu": mfu,
            "eval_first": evals[0], "eval_last": evals[-1]}


def part_diloco(run_dir: Path) -> dict:
    cmd = [sys.executable, "launch/local.py", "--nodes", "2", "--config", "configs/cpu-demo.toml",
           "--run-dir", str(run_dir), *_flags(DILOCO_OVERRIDES)]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    summary = [ln.strip() for ln in out.splitlines() if re.search(r"node\d: \d+ inner steps|bit-identical", ln)]
    identical = re.search(r"outer steps committed by every node: (\d+); models bit-identical at each: (\w+)", out)
    committed = int(identical.group(1)) if identical else 0
    ok = proc.returncode == 0 and identical is not None and identical.group(2) == "True" and committed >= 3
    line = (f"diloco: 2 nodes on one GPU, exit {proc.returncode}, {time.monotonic() - started:.0f} s; "
            + (" | ".join(summary) if summary else "no summary (see the log)"))
    if not ok:
        sys.stderr.write(out[-4000:])
    return {"ok": ok, "line": line, "committed": committed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="example: python launch/gpu_smoke.py --parts codec,train --steps 200")
    parser.add_argument("--parts", default="codec,train,diloco", help="comma-separated: codec, train, diloco")
    parser.add_argument("--steps", type=int, default=200, help="inner steps of the train part (default 200)")
    parser.add_argument("--run-dir", type=Path, default=REPO / "runs" / "gpu-smoke")
    parser.add_argument("--out", type=Path, default=None, help="write every part's result here as JSON")
    args = parser.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - {"codec", "train", "diloco"}
    if unknown:
        parser.error(f"unknown part(s) {', '.join(sorted(unknown))}; choose from codec, train, diloco")
    import torch

    if not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device visible; run it on a GPU machine", file=sys.stderr)
        return 2
    print(f"gpu_smoke: torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
          f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    results: dict[str, dict] = {}
    runners = {"codec": part_codec, "train": lambda: part_train(args.steps, args.run_dir / "train"),
               "diloco": lambda: part_diloco(args.run_dir / "diloco")}
    for part in parts:
        try:
            results[part] = runners[part]()
        except Exception as exc:  # one broken part must not hide the others' figures
            traceback.print_exc()
            results[part] = {"ok": False, "line": f"{part}: failed: {type(exc).__name__}: {exc}"}
        print(("PASS " if results[part]["ok"] else "FAIL ") + results[part]["line"], flush=True)
        if args.out:
            args.out.write_text(json.dumps(results, indent=2, default=str))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
