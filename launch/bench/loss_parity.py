"""Benchmark: final eval loss of DiLoCo (M nodes, int8) against data-parallel and one node, at equal steps.

DiLoCo: M nodes of one rank each (a local cluster), reading shards leased from the coordinator.
Data-parallel: one node of M ranks (FSDP2) with M× the batch, so both see as many sequences per step
and tokens in all. One node: one rank with the per-replica batch, as many steps (what a single
DiLoCo replica sees). Every final checkpoint is evaluated by this script on the same held-out
sequences. Targets: ratio to data-parallel ≤ 1.01 with 2 nodes, ≤ 1.02 with 4; below one node beyond
the spread over seeds.

Every DiLoCo option takes a comma-separated list: the run is the product of them over the seeds, each
baseline run once per seed and batch; results are appended to --results as they finish (a rerun with
the same file skips what it holds; an arm of another --steps than 150 is its own, compared only with baselines
of its length), then one table (mean ± spread over seeds) and, with --plot, a PNG.

    python launch/bench/loss_parity.py [--nodes 2] [--steps 150] [--inner-steps 10]
    python launch/bench/loss_parity.py --nodes 2 --inner-steps 10,25,50 --outer-lr 0.4,0.7,1.0 \\
        --seeds 0,1,2 --results runs/sweep.jsonl --plot docs/img/sweep.png
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]

from launch.cluster import LocalCluster, child_env
from prime.config import load_config
from prime.core.checkpoint import CheckpointStore
from prime.core.model import build_model
from prime.data.builtin_corpus import prepare
from prime.data.loader import (
    BatchIterator,
    DataConfig,
    PackedSequenceStream,
    eval_shards,
    train_and_eval_files,
)
from prime.data.tokenizer import ByteTokenizer

DEFAULT_STEPS = 150  # an arm run at another length carries "steps" (a result is reused only for its own length)
# The DiLoCo options a sweep varies: flag -> (config key, type).
SWEPT = {
    "inner_steps": ("diloco.inner_steps", int),
    "outer_lr": ("diloco.outer_lr", float),
    "outer_momentum": ("diloco.outer_momentum", float),
    "mode": ("diloco.mode", str),
    "eager": ("diloco.eager", str),
    "overlap_steps": ("diloco.overlap_steps", int),
    "inner_optimizer": ("diloco.inner_optimizer", str),
    "warmup": ("optim.warmup_steps", int),
    "batch_mult": (None, int),  # the per-replica batch, in multiples of the config's (baselines follow it)
    "compression": ("diloco.compression", str),  # int8 (the default: left out of an arm, so older results match) or sparse
    "sparse_k": ("diloco.sparse.k", int),
    "error_decay": ("diloco.sparse.error_decay", float),
}


@torch.no_grad()
def eval_loss(config, checkpoint: Path, corpus: Path, batches: int = 16) -> float:
    model = build_model(config.model, 0)
    CheckpointStore.load_model(checkpoint, model)
    model.eval()
    _, eval_files = train_and_eval_files(DataConfig(path=str(corpus)))
    stream = PackedSequenceStream(eval_shards(eval_files, 0, 1), ByteTokenizer(), config.train.seq_len)
    it, total = BatchIterator(stream, 8), 0.0
    for _ in range(batches):
        inputs, labels = next(it)
        total += F.cross_entropy(model(input_ids=inputs).logits.flatten(0, 1), labels.flatten()).item()
    return total / batches


def _list(kind):
    return lambda text: [kind(v) for v in text.split(",")]


def arm_key(arm: dict) -> str:
    return json.dumps(arm, sort_keys=True)


def run_arm(arm: dict, args, config, corpus: Path, tmp: Path) -> float:
    """Trains one arm in `tmp` and returns its final eval loss."""
    batch = config.train.batch_size * arm["batch_mult"]
    common = ["--data.path", str(corpus), "--train.max_steps", str(arm.get("steps", DEFAULT_STEPS)), "--train.eval_every", "0",
              "--checkpoint.every", "0", "--quiet", "--train.seed", str(arm["seed"]), "--data.seed", str(arm["seed"]),
              "--optim.warmup_steps", str(arm.get("warmup", config.optim.warmup_steps))]
    steps = arm.get("steps", DEFAULT_STEPS)
    final = f"step_{steps:08d}"
    if arm["kind"] == "diloco":
        flags = list(common) + ["--train.batch_size", str(batch)]
        for name, (key, _) in SWEPT.items():
            if key and key.startswith("diloco.") and name in arm:
                flags += [f"--{key}", str(arm[name])]
        with LocalCluster(tmp / "diloco", args.config, flags, coordinator_args=["--min-wait-s", "60"]) as c:
            c.run_nodes([f"node{i}" for i in range(arm["nodes"])], 7200)
        return eval_loss(config, tmp / "diloco" / "node0" / "checkpoints" / final, corpus)
    ranks = arm["nodes"] if arm["kind"] == "data-parallel" else 1
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc-per-node={ranks}",
           "-m", "prime.train", "--config", args.config, "--run-dir", str(tmp / "run"),
           "--train.batch_size", str(batch * ranks), *common]
    subprocess.run(cmd, cwd=REPO, env=child_env(), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return eval_loss(config, tmp / "run" / "checkpoints" / final, corpus)


def plan(args, config) -> list[dict]:
    """Every arm to run: the DiLoCo product, then the baselines it compares with."""
    values = {name: getattr(args, name) for name in SWEPT if getattr(args, name) is not None}
    values.setdefault("batch_mult", [1])
    values.setdefault("warmup", [config.optim.warmup_steps])
    names = sorted(values)
    length = {"steps": args.steps} if args.steps != DEFAULT_STEPS else {}
    arms = []
    for seed in args.seeds:
        for combo in itertools.product(*(values[n] for n in names)):
            arm = {"kind": "diloco", "nodes": args.nodes, "seed": seed, **dict(zip(names, combo)), **length}
            if arm.get("compression") == "int8":
                del arm["compression"]  # the default, as every arm before the option existed ran
            if arm.get("compression") != "sparse" and any(k in arm for k in ("sparse_k", "error_decay")):
                continue  # sparse settings mean nothing to a dense arm
            arms.append(arm)
        for mult in values["batch_mult"]:
            for warmup in values["warmup"]:
                for kind in ("data-parallel", "one node") if args.baselines else ():
                    arms.append({"kind": kind, "nodes": args.nodes if kind == "data-parallel" else 1, "seed": seed,
                                 "batch_mult": mult, "warmup": warmup, **length})
    return arms


def summarise(results: dict[str, float], arms: list[dict]) -> list[dict]:
    """One row per arm without its seed: mean and spread over seeds, ratios to the baselines' means over
    the same seeds."""
    groups: dict[str, dict[int, float]] = {}  # arm without its seed -> seed -> eval loss
    shapes: dict[str, dict] = {}
    for arm in arms:
        if arm_key(arm) in results:
            shape = {k: v for k, v in arm.items() if k != "seed"}
            groups.setdefault(arm_key(shape), {})[arm["seed"]] = results[arm_key(arm)]
            shapes[arm_key(shape)] = shape
    rows = []
    for key, by_seed in groups.items():
        shape, losses = shapes[key], list(by_seed.values())
        row = {**shape, "seeds": len(losses), "mean": statistics.fmean(losses),
               "spread": (max(losses) - min(losses)) / 2 if len(losses) > 1 else 0.0}
        for kind in ("data-parallel", "one node"):
            base = {"kind": kind, "nodes": shape["nodes"] if kind == "data-parallel" else 1,
                    "batch_mult": shape["batch_mult"], "warmup": shape.get("warmup"),
                    **({"steps": shape["steps"]} if "steps" in shape else {})}
            ref = groups.get(arm_key(base), {})
            same = [ref[seed] for seed in by_seed if seed in ref]
            row[kind] = statistics.fmean(same) if len(same) == len(by_seed) else None
        rows.append(row)
    return rows


def _label(row: dict) -> str:
    return {"diloco": f"DiLoCo M={row['nodes']}", "data-parallel": f"data-parallel, {row['nodes']} ranks"}.get(
        row["kind"], row["kind"])


def table(rows: list[dict], args) -> str:
    swept = [n for n in SWEPT if any(n in r for r in rows if r["kind"] == "diloco")]
    swept += ["steps"] if any("steps" in r for r in rows) else []
    head = ["arm", *swept, "seeds", "eval loss (mean ± half-range)", "/ data-parallel", "/ one node"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: (r["kind"] != "diloco", r["mean"])):
        ratio = [f"{r['mean'] / r[k]:.4f}" if r.get(k) and r["kind"] != k else "" for k in ("data-parallel", "one node")]
        cells = [_label(r),
                 *[str(r.get(n, DEFAULT_STEPS if n == "steps" else "")) if r["kind"] == "diloco" or
                   n in ("batch_mult", "warmup", "steps") else "" for n in swept],
                 str(r["seeds"]), f"{r['mean']:.4f} ± {r['spread']:.4f}", *ratio]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: (r["kind"] != "diloco", r["mean"]))
    short = {"inner_steps": "H", "outer_lr": "lr", "outer_momentum": "mom", "mode": "", "eager": "eager",
             "overlap_steps": "tau", "inner_optimizer": "AdamW",
             "warmup": "warm-up", "batch_mult": "batch x", "compression": "", "sparse_k": "k", "error_decay": "decay"}
    varied = {k for k in SWEPT if len({r.get(k) for r in rows if r["kind"] == "diloco"}) > 1}
    # A baseline's own settings, where the baselines differ in them (warm-up, batch): else two bars read alike.
    base_varied = [k for k in ("warmup", "batch_mult") if len({r.get(k) for r in rows if r["kind"] != "diloco"}) > 1]
    labels = [_label(r) + "".join(f", {short[k]}={r.get(k)}" for k in base_varied) if r["kind"] != "diloco"
              else _label(r) + ": " + " ".join(
              f"{short[k]}{'=' if short[k] else ''}{r[k]}" for k in SWEPT if k in r and (k in varied or k in
                                                                                        ("inner_steps", "outer_lr",
                                                                                         "outer_momentum")))
              for r in rows]
    labels = [label + (f", {r['steps']} steps" if "steps" in r else "") for label, r in zip(labels, rows)]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.5))
    colors = ["tab:blue" if r["kind"] == "diloco" else "tab:gray" for r in rows]
    ax.barh(range(len(rows)), [r["mean"] for r in rows], xerr=[r["spread"] for r in rows], color=colors)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    low = min(r["mean"] - r["spread"] for r in rows)
    ax.set_xlim(low - 0.05, max(r["mean"] + r["spread"] for r in rows) + 0.02)
    ax.set_xlabel("final eval loss (bars: mean over seeds; whiskers: half the range)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--config", default="configs/cpu-demo.toml")
    parser.add_argument("--seeds", type=_list(int), default=[0], help="train.seed and data.seed of each run")
    for name, (key, kind) in SWEPT.items():
        flag = name.replace("_", "-")
        parser.add_argument(f"--{flag}", type=_list(kind), default=None,
                            help=f"{key} (list; default: the config's)" if key else
                            "the per-replica batch in multiples of train.batch_size (list; default 1)")
    parser.add_argument("--no-baselines", dest="baselines", action="store_false",
                        help="run DiLoCo arms only (the table then has no ratios unless --results holds them)")
    parser.add_argument("--results", type=Path, default=None, help="JSONL of finished arms, appended and reused")
    parser.add_argument("--plot", type=Path, default=None, help="write the table as a bar chart (PNG)")
    parser.add_argument("--report", action="store_true",
                        help="run nothing: the table (and plot) of every arm in --results, whatever the other flags")
    args = parser.parse_args()
    if args.report and not (args.results and args.results.exists()):
        parser.error("--report needs --results FILE of finished runs")
    corpus = prepare()
    config = load_config(REPO / args.config)
    results: dict[str, float] = {}
    finished: list[dict] = []
    if args.results and args.results.exists():
        for line in args.results.read_text().splitlines():
            entry = json.loads(line)
            results[arm_key(entry["arm"])] = entry["eval_loss"]
            finished.append(entry["arm"])
    arms = finished if args.report else plan(args, config)
    todo = [a for a in arms if arm_key(a) not in results]
    print(f"{args.config}, {args.nodes} nodes, {args.steps} steps: {len(arms)} runs, {len(todo)} to do", flush=True)
    for number, arm in enumerate(todo, 1):
        started = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            loss = run_arm(arm, args, config, corpus, Path(tmp))
        results[arm_key(arm)] = loss
        if args.results:
            args.results.parent.mkdir(parents=True, exist_ok=True)
            with args.results.open("a") as f:
                f.write(json.dumps({"arm": arm, "eval_loss": loss, "s": round(time.monotonic() - started)}) + "\n")
        print(f"[{number}/{len(todo)}] {arm_key(arm)}: eval loss {loss:.4f} ({time.monotonic() - started:.0f} s)",
              flush=True)
    rows = summarise(results, arms)
    tokens = args.steps * config.train.batch_size * config.train.seq_len * 2
    seeds = sorted({a["seed"] for a in arms})
    print(f"\n{args.config}, {args.steps} steps, {tokens / 1e6:.2f}M tokens per 2-node run (×nodes/2, ×batch_mult), "
          f"seeds {seeds}")
    print(table(rows, args))
    if len(arms) == (3 if args.baselines else 1) * len(args.seeds) and len(args.seeds) == 1:
        diloco = next(r for r in rows if r["kind"] == "diloco")
        if diloco.get("data-parallel"):
            print(f"eval loss: DiLoCo (int8) {diloco['mean']:.4f}, data-parallel {diloco['data-parallel']:.4f}, "
                  f"ratio {diloco['mean'] / diloco['data-parallel']:.4f}")
    if args.plot:
        other = " (or as a bar says)" if any(r.get("steps", args.steps) != args.steps for r in rows) else ""
        plot(rows, args.plot, f"{args.config}, {args.steps} steps{other}, seeds {seeds}")
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
