"""GPU smoke test: the CUDA path end to end on one GPU, in about 8 minutes, in four independent parts.

- codec:  the int8 and bf16 wire codecs on CUDA tensors: encode+decode throughput, error, and whether
          a GPU and a CPU member turn the same values into the same bytes and floats (they must: every
          member decodes the all-reduce to the same model).
- train:  `prime.train` under torchrun (NCCL local group), FSDP2 applied even to the single rank, bf16
          compute, activation checkpointing, on the built-in corpus; tokens/s and MFU from metrics.jsonl.
- diloco: `launch/local.py` with two DiLoCo nodes sharing the GPU (each its own torchrun and NCCL
          group, the global Gloo group and int8 all-reduce between them); passes when every node's model
          is bit-identical after every committed outer step.
- toploc: TOPLOC on CUDA with the policy given by --policy (an HF directory calibrated on CPU): honest
          rollouts generated on the GPU and verified on the CPU with the CPU's thresholds (does
          calibration carry across devices?); calibration on the GPU for float32 and bfloat16 workers;
          the attack suite and the v-1 sweep against those thresholds; proof-building overhead and
          verify/generate on a 1B-shape model (random weights, bf16 worker, float32 verifier).

Each part prints one line; a failing part does not stop the others. `--out FILE` writes them as JSON.
Cannot run without a GPU.

    python launch/gpu_smoke.py [--parts codec,train,diloco,toploc] [--steps 200] [--policy DIR] [--out F]
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


def part_toploc(policy: Path, work: Path, device: str = "cuda", cost_shape: dict | None = None) -> dict:
    """`device` and `cost_shape` let a CPU dry run exercise the same code with a small model."""
    import copy
    import shutil

    import torch
    from transformers import AutoTokenizer

    from prime.core.model import ModelConfig, build_model
    from prime.inference.engine import GenerationRequest
    from prime.inference.hf_engine import HFEngine, eos_id_of, load_hf_policy
    from prime.inference.sampling import SamplingParams
    from prime.testing.tiny_policy import next_version
    from prime.testing.toploc_attacks import (
        ATTACKS,
        AttackContext,
        honest_claims,
        int8_weights,
    )
    from prime.verify.calibrate import calibrate, corpus_prompts, generate_claims
    from prime.verify.proof import ProofSettings, proof_observer
    from prime.verify.thresholds import ToplocThresholds
    from prime.verify.verifier import Claim, Verifier

    out: dict = {}
    tokenizer = AutoTokenizer.from_pretrained(policy, local_files_only=True)
    tokenize = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    cpu_thresholds = ToplocThresholds.load(policy)
    proof = cpu_thresholds.proof
    gpu_model = load_hf_policy(policy, torch.float32, device)
    eos = eos_id_of(gpu_model)

    # 1. A GPU worker, a CPU verifier with the CPU's calibration.
    claims = honest_claims(gpu_model, tokenize, proof, eos, seed=31)
    cpu_verdicts = Verifier(load_hf_policy(policy), cpu_thresholds, eos).verify(claims)
    rejected = [v for v in cpu_verdicts if not v.accepted]
    out["gpu_worker_cpu_verifier"] = {"rollouts": len(claims), "rejected": len(rejected),
                                      "by_check": {c: sum(c in v.rejected_by for v in rejected) for c in
                                                   ("activations", "sampling", "logprobs", "termination")},
                                      "examples": [v.reason[:200] for v in rejected[:3]]}
    print(f"toploc: GPU worker, CPU verifier, CPU thresholds: {len(rejected)}/{len(claims)} rejected", flush=True)

    # 2. Calibration on the GPU for float32 and bfloat16 workers.
    gpu_dir = work / "policy-gpu"
    shutil.rmtree(gpu_dir, ignore_errors=True)
    shutil.copytree(policy, gpu_dir)
    started = time.perf_counter()
    thresholds = calibrate(gpu_dir, ["float32", "bfloat16"], [1], [1, 16, 64], 32, 128, 2.0, 0, proof, device=device)
    thresholds.save(gpu_dir)
    out["gpu_calibration"] = {"seconds": round(time.perf_counter() - started, 1), "chunks": thresholds.calibration.chunks,
                              "maxima": {d: m.model_dump() for d, m in thresholds.calibration.honest_maxima.items()},
                              "limits": {d: m.model_dump() for d, m in thresholds.limits.items()}}
    print(f"toploc: GPU calibration {out['gpu_calibration']}", flush=True)

    # 3. Honest and dishonest workers against the GPU thresholds (the verifier on the GPU too).
    model = next_version(gpu_model, lr=1e-5)
    verifier = Verifier(model, thresholds, eos)
    honest = honest_claims(model, tokenize, proof, eos, seed=77)
    bf16 = honest_claims(copy.deepcopy(model).to(torch.bfloat16), tokenize, proof, eos, seed=78)
    chunks = sum(proof.chunks_for(len(c.completion.tokens)) for c in honest + bf16)
    false = [v.reason[:200] for v in verifier.verify(honest + bf16) if not v.accepted]
    out["honest"] = {"chunks": chunks, "false_rejects": len(false), "examples": false[:3]}
    sampling = SamplingParams(temperature=1.0, top_p=0.8, max_tokens=96)
    requests = [GenerationRequest(p, seed=9000 + i, sampling=sampling)
                for i, p in enumerate(corpus_prompts(tokenize, 16, seed=77))]
    context = AttackContext(model, gpu_model, generate_claims(model, requests, 16, 1, proof, eos_id=eos), proof, eos)
    attacks = {}
    for attack in ATTACKS:
        verdicts = verifier.verify(attack.forge(context))
        attacks[attack.name] = f"{sum(attack.expected_check in v.rejected_by for v in verdicts)}/{len(verdicts)}"
    out["attacks"] = attacks
    # How small a change each worker dtype's limits still see: v-1 claimed as v, and int8 weights,
    # generated in float32 and in bfloat16 (each held to its own dtype's limits).
    sweep = {}
    for dtype in (torch.float32, torch.bfloat16):
        stale = copy.deepcopy(gpu_model).to(dtype)
        for lr in (1e-3, 1e-4, 1e-5, 1e-6):
            probe = Verifier(next_version(gpu_model, lr=lr), thresholds, eos)
            verdicts = probe.verify(context.regenerate(stale))
            sweep[f"{dtype} v-1 lr {lr:g}"] = f"{sum(not v.accepted for v in verdicts)}/{len(verdicts)}"
        verdicts = verifier.verify(context.regenerate(int8_weights(model).to(dtype)))
        sweep[f"{dtype} int8"] = f"{sum(not v.accepted for v in verdicts)}/{len(verdicts)}"
    out["floor"] = sweep
    print(f"toploc: honest {out['honest']}, attacks {attacks}, floor {sweep}", flush=True)

    # 4. Cost on a 1B-shape model: bf16 worker at batch 64, float32 verifier.
    shape = ModelConfig(**(cost_shape or dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=16,
                                              num_heads=16, num_kv_heads=8, max_position_embeddings=1024)))
    reference = build_model(shape, seed=0, device=device).eval()
    worker = build_model(shape, seed=0, device=device).to(torch.bfloat16).eval()
    engine = HFEngine(worker, eos_id=shape.vocab_size - 1, observer=proof_observer(ProofSettings()))
    requests = [GenerationRequest([int(t) % 31999 for t in corpus_prompts(tokenize, 1, seed=i)[0]], seed=i,
                                  sampling=SamplingParams(max_tokens=256)) for i in range(64)]
    engine.generate(requests[:8])
    engine.stats.total_s = engine.stats.proof_s = engine.stats.tokens = 0
    completions = engine.generate(requests)
    claims = [Claim(r.prompt, r.seed, r.sampling, c) for r, c in zip(requests, completions)]
    big_verifier = Verifier(reference, thresholds, eos_id=shape.vocab_size - 1, batch_size=16)
    recompute_started = time.perf_counter()
    big_verifier.verify(claims)
    if device == "cuda":
        torch.cuda.synchronize()
    verify_s = time.perf_counter() - recompute_started
    out["cost_1b"] = {"tokens": engine.stats.tokens, "generate_s": round(engine.stats.total_s, 2),
                      "proof_share_pct": round(100 * engine.stats.proof_s / engine.stats.total_s, 3),
                      "verify_over_generate": round(verify_s / engine.stats.total_s, 4)}
    print(f"toploc: 1B-shape cost {out['cost_1b']}", flush=True)
    detected = sum(a.split("/")[0] == a.split("/")[1] for a in attacks.values())
    ok = out["honest"]["false_rejects"] == 0 and detected == len(attacks)
    line = (f"toploc: GPU worker vs CPU thresholds {len(rejected)}/{len(claims)} rejected; GPU-calibrated: "
            f"false rejects {len(false)}/{chunks} chunks, attacks {detected}/{len(attacks)}, 1B bf16 proof {out['cost_1b']['proof_share_pct']}% verify/generate "
            f"{out['cost_1b']['verify_over_generate']}")
    return {"ok": ok, "line": line, **out}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="example: python launch/gpu_smoke.py --parts codec,train --steps 200")
    parser.add_argument("--parts", default="codec,train,diloco", help="comma-separated: codec, train, diloco, toploc")
    parser.add_argument("--policy", type=Path, default=None,
                        help="toploc part: an HF policy directory with a CPU toploc.json (from prime.verify.calibrate)")
    parser.add_argument("--steps", type=int, default=200, help="inner steps of the train part (default 200)")
    parser.add_argument("--run-dir", type=Path, default=REPO / "runs" / "gpu-smoke")
    parser.add_argument("--out", type=Path, default=None, help="write every part's result here as JSON")
    args = parser.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - {"codec", "train", "diloco", "toploc"}
    if unknown:
        parser.error(f"unknown part(s) {', '.join(sorted(unknown))}; choose from codec, train, diloco, toploc")
    if "toploc" in parts and args.policy is None:
        parser.error("the toploc part needs --policy DIR")
    import torch

    if not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device visible; run it on a GPU machine", file=sys.stderr)
        return 2
    print(f"gpu_smoke: torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
          f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    results: dict[str, dict] = {}
    runners = {"codec": part_codec, "train": lambda: part_train(args.steps, args.run_dir / "train"),
               "diloco": lambda: part_diloco(args.run_dir / "diloco"),
               "toploc": lambda: part_toploc(args.policy, args.run_dir / "toploc")}
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
