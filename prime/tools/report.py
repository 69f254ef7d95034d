"""Plots and a summary of a finished (or running) run, from the files it wrote.

    python -m prime.tools.report runs/demo            # writes runs/demo/report/{loss,timeline,membership}.png + summary.md

Reads every node's metrics.jsonl (RUN_DIR/<node>/metrics.jsonl, or RUN_DIR/metrics.jsonl for a single
node) and, when present, the coordinator's state (RUN_DIR/coordinator/coordinator.sqlite, read-only)
for aborted attempts and membership. Never writes anywhere but the output directory.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class NodeRun:
    name: str
    steps: list[dict] = field(default_factory=list)   # inner-step records
    evals: list[dict] = field(default_factory=list)   # eval records
    outer: list[dict] = field(default_factory=list)   # outer-step records


def load_nodes(run_dir: Path) -> list[NodeRun]:
    files = sorted(run_dir.glob("*/metrics.jsonl")) or sorted(run_dir.glob("metrics.jsonl"))
    if not files:
        raise FileNotFoundError(f"no metrics.jsonl under {run_dir} (nor in its sub-directories); pass the --run-dir "
                                "a run was started with (launch/local.py puts nodes in RUN_DIR/nodeK/)")
    nodes = []
    for path in files:
        node = NodeRun(path.parent.name if path.parent != run_dir else run_dir.name)
        for number, line in enumerate(path.read_text().splitlines(), 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                print(f"warning: {path}:{number} is not JSON (a line cut by a crash?); skipped", file=sys.stderr)
                continue
            if "outer_step" in record:
                node.outer.append(record)
            elif "eval_loss" in record:
                node.evals.append(record)
            elif "loss" in record:
                node.steps.append(record)
        nodes.append(node)
    return nodes


def load_coordinator_steps(run_dir: Path) -> list[dict]:
    """Every outer-step attempt the coordinator decided, or [] for a run without one."""
    path = run_dir / "coordinator" / "coordinator.sqlite"
    if not path.exists():
        return []
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        # The coordinator speaks of rounds: for a DiLoCo run, round k is outer step k.
        rows = db.execute("SELECT round, attempt, epoch, members, decision, decided_at, allreduce_s FROM rounds "
                          "ORDER BY round, attempt").fetchall()
    finally:
        db.close()
    return [{"outer_step": r[0], "attempt": r[1], "epoch": r[2], "members": [m["name"] for m in json.loads(r[3])],
             "decision": r[4], "decided_at": r[5], "allreduce_s": r[6]} for r in rows]


def _color(i: int) -> str:
    return f"C{i if i < 3 else i + 1}"  # C3 (red) marks aborted attempts


def _ema(values: list[float], alpha: float = 0.1) -> list[float]:
    out, current = [], None
    for v in values:
        current = v if current is None else alpha * v + (1 - alpha) * current
        out.append(current)
    return out


def plot_loss(nodes: list[NodeRun], out: Path, plt) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, node in enumerate(nodes):
        color = _color(i)
        tokens = [r["tokens"] for r in node.steps]
        losses = [r["loss"] for r in node.steps]
        ax.plot(tokens, losses, color=color, alpha=0.2, linewidth=0.8)
        ax.plot(tokens, _ema(losses), color=color, linewidth=1.6, label=f"{node.name} train loss (EMA)")
        if node.evals:
            ax.plot([r["tokens"] for r in node.evals], [r["eval_loss"] for r in node.evals], "o--", color=color,
                    markersize=4, linewidth=1, label=f"{node.name} eval loss")
    ax.set_xlabel("tokens seen by the node")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("Loss vs tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "loss.png", plt)


def plot_timeline(nodes: list[NodeRun], attempts: list[dict], out: Path, plt) -> Path:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=False)
    start = min([r["time"] for n in nodes for r in n.steps[:1]] or [0])
    for i, node in enumerate(nodes):
        top.step([(r["time"] - start) / 60 for r in node.outer], [r["outer_step"] for r in node.outer], where="post",
                 color=_color(i), label=node.name)
    top.set_xlabel("minutes since the first step")
    top.set_ylabel("outer step committed")
    top.grid(alpha=0.3)
    top.legend(fontsize=8)
    if attempts:
        applied = [a for a in attempts if a["decision"] == "apply" and a["allreduce_s"] is not None]
        aborted = [a for a in attempts if a["decision"] == "abort" and a["allreduce_s"] is not None]
        bottom.bar([a["outer_step"] for a in applied], [a["allreduce_s"] for a in applied], color="C0", label="applied")
        if aborted:
            bottom.bar([a["outer_step"] for a in aborted], [a["allreduce_s"] for a in aborted], color="C3",
                       label="aborted attempt")
        bottom.legend(fontsize=8)
    else:
        for i, node in enumerate(nodes):
            bottom.plot([r["outer_step"] for r in node.outer], [r["allreduce_s"] for r in node.outer], "o-",
                        color=_color(i), markersize=3)
    bottom.set_xlabel("outer step")
    bottom.set_ylabel("all-reduce time (s)")
    bottom.grid(alpha=0.3)
    fig.suptitle("Outer steps over time")
    return _save(fig, out / "timeline.png", plt)


def plot_membership(nodes: list[NodeRun], attempts: list[dict], out: Path, plt) -> Path:
    if attempts:
        names = sorted({m for a in attempts for m in a["members"]})
        applied = {name: [a["outer_step"] for a in attempts if a["decision"] == "apply" and name in a["members"]]
                   for name in names}
        aborted = {name: [a["outer_step"] for a in attempts if a["decision"] == "abort" and name in a["members"]]
                   for name in names}
    else:
        names = [n.name for n in nodes]
        applied = {n.name: [r["outer_step"] for r in n.outer] for n in nodes}
        aborted = {name: [] for name in names}
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(names) + 1.4))
    for i, name in enumerate(names):
        ax.broken_barh([(s - 0.5, 0.95) for s in applied[name]], (i - 0.35, 0.7), color=_color(i))
        ax.broken_barh([(s - 0.5, 0.95) for s in aborted[name]], (i - 0.1, 0.2), color="C3")
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("outer step (red: an attempt that aborted)")
    ax.set_title("Membership: who was averaged in each outer step")
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, out / "membership.png", plt)


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary_markdown(run_dir: Path, nodes: list[NodeRun], attempts: list[dict]) -> str:
    lines = [f"# Run report: {run_dir.name}", "",
             "| node | inner steps | tokens | loss first → last | last eval loss | outer steps | tokens contributed "
             "| median tokens/s | MB sent | median all-reduce (s) |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for node in nodes:
        steps, outer = node.steps, node.outer
        last = node.evals[-1]["eval_loss"] if node.evals else None
        lines.append(
            f"| {node.name} | {len(steps)} | {steps[-1]['tokens'] if steps else 0:,} | "
            + (f"{steps[0]['loss']:.3f} → {steps[-1]['loss']:.3f}" if steps else "–")
            + f" | {f'{last:.4f}' if last is not None else '–'} | {len(outer)} | "
            + f"{outer[-1].get('tokens_contributed', 0) if outer else 0:,} | "
            + f"{statistics.median(r['tokens_per_s'] for r in steps) if steps else 0:,.0f} | "
            + f"{sum(r.get('bytes_sent', 0) for r in outer) / 1e6:,.1f} | "
            + (f"{statistics.median(r['allreduce_s'] for r in outer):.3f}" if outer else "–") + " |")
    if attempts:
        applied = [a for a in attempts if a["decision"] == "apply"]
        aborted = [a for a in attempts if a["decision"] == "abort"]
        epochs = sorted({a["epoch"] for a in applied})
        lines += ["", f"Coordinator: {len(applied)} outer steps committed, {len(aborted)} attempts aborted and retried, "
                      f"{len(epochs)} epoch(s) (membership changes); at most "
                      f"{max(len(a['members']) for a in applied) if applied else 0} nodes in one step."]
    hashes: dict[int, set[str]] = {}
    for node in nodes:
        for r in node.outer:
            hashes.setdefault(r["outer_step"], set()).add(r.get("model_hash"))
    shared = [s for s, h in hashes.items() if len(h) == 1]
    if hashes:
        lines += ["", f"Model hashes: identical across nodes at {len(shared)} of {len(hashes)} outer steps."]
    lines += ["", "![loss](loss.png)", "", "![timeline](timeline.png)", "", "![membership](membership.png)", ""]
    return "\n".join(lines)


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display is needed or wanted
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    out = Path(out or run_dir / "report")
    out.mkdir(parents=True, exist_ok=True)
    nodes = load_nodes(run_dir)
    attempts = load_coordinator_steps(run_dir)
    plot_loss(nodes, out, plt)
    plot_timeline(nodes, attempts, out, plt)
    plot_membership(nodes, attempts, out, plt)
    (out / "summary.md").write_text(summary_markdown(run_dir, nodes, attempts))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Write PNG plots (loss vs tokens, outer-step timeline, membership) and a markdown summary of a run.",
        epilog="example: python -m prime.tools.report runs/demo   (then open runs/demo/report/summary.md)")
    parser.add_argument("run_dir", type=Path, help="the run directory (launch/local.py --run-dir, or prime.train's)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default RUN_DIR/report)")
    args = parser.parse_args(argv)
    try:
        out = write_report(args.run_dir, args.out)
    except (FileNotFoundError, sqlite3.DatabaseError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"report written to {out} (summary.md, loss.png, timeline.png, membership.png)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
