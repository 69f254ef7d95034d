"""Benchmark: compute utilisation of DiLoCo across an emulated WAN, per diloco.mode, side by side.

The same nodes (each in its own namespace behind the chosen profile) train the same config once per
mode (int8 all-reduce over the WAN: `blocking` waits for it every H steps, `delayed` runs it behind
the next round, `streaming` synchronises one of F fragments every H/F steps, each behind H/F steps of
compute), with communication switched off (each node trains alone, no coordinator) for
--reference-steps before every run and after the last. Utilisation = tokens/s with communication /
tokens/s without, the latter the mean of the two communication-off passes around the run (this
machine's speed drifts by 10-25% between passes; `ref drift` shows how much the two differed): over
the whole run, and the steady state (rounds 2 to the one before last: the first holds start-up, and
the last round of `delayed` waits for its own all-reduce so the run ends on the average). Also prints each
mode's final eval loss (equal tokens), the largest transfer of one outer step with the rate it needs
to stay hidden (its bytes / the compute time it overlaps), and the peak rate on the wire: the most any
node's link delivered to it in any 1 s of the steady state (sampled every 0.25 s), against blocking's.
`steps share`: the share of the steady state's wall time the inner steps themselves took (the rest:
waiting for outer steps), which does not drift with the machine's speed between passes.
`--paces 0,0.8` runs each overlapped mode once per diloco.pace (its all-reduces spread over that
fraction of their window; 0: at the link's rate). `--overlaps 0,20` runs each overlapped mode once
per diloco.overlap_steps τ as well (0: H for delayed, H/F for streaming; under H, delayed applies the
average sooner; over H/F, several streaming fragments are in flight at once).
`kernel-paced` counts the outer steps whose connections the kernel paced as well as the token bucket
(mesh.kernel_pacing; only paced runs have any). `lag`: the median inner steps between an overlapped
outer step's launch and its application (τ, or fewer with diloco.apply_early: a run named with `:e`).
INTELLECT-1: 83% globally, 96% in the US.

    python launch/bench/utilisation.py [--profile global] [--nodes 2] [--steps 150] [--inner-steps 25] [--paces 0,0.8] [--overlaps 0]
    python launch/bench/utilisation.py --inner-steps 50 --steps 200 --runs blocking,streaming:p0.9,delayed:t25,delayed:t20:e
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

from launch.cluster import LocalCluster, child_env
from launch.wan.harness import PROFILES, WanTopology, WireMeter
from prime.data.builtin_corpus import prepare


def tokens_per_s(cluster: LocalCluster, names: list[str], first: int = 0, last: int | None = None) -> float:
    """Tokens/s of all nodes together between inner steps first and last (every step's record)."""
    total, spans = 0, []
    for name in names:
        steps = [r for r in cluster.metrics(name) if "loss" in r and first <= r["step"] <= (last or r["step"])]
        total += steps[-1]["tokens"] - steps[0]["tokens"]
        spans.append(steps[-1]["time"] - steps[0]["time"])
    return total / max(spans)


def compute_share(cluster: LocalCluster, names: list[str], first: int, last: int) -> float:
    """The share of wall time the inner steps themselves took between inner steps first and last, per
    node, averaged: the rest went to waiting for outer steps. Unlike the ratio to the communication-off
    pass it does not move with the machine's speed between passes, but it cannot see compute slowed by
    the background transfers (their threads share the cores)."""
    shares = []
    for name in names:
        steps = [r for r in cluster.metrics(name) if "loss" in r and first < r["step"] <= last]
        shares.append(sum(r["step_s"] for r in steps) / (steps[-1]["time"] - steps[0]["time"] + steps[0]["step_s"]))
    return sum(shares) / len(shares)


def run_spec(spec: str) -> tuple[str, float, int, bool]:
    """'delayed:p0.8:t25:e' -> ("delayed", 0.8, 25, True): a mode, its diloco.pace, diloco.overlap_steps
    and diloco.apply_early (e)."""
    mode, *options = spec.strip().split(":")
    if mode not in ("blocking", "delayed", "streaming"):
        raise ValueError(f"--runs: {spec!r} does not start with blocking, delayed or streaming")
    pace, tau, early = 0.0, 0, False
    for option in options:
        try:
            if option[:1] == "p":
                pace = float(option[1:])
            elif option[:1] == "t":
                tau = int(option[1:])
            elif option == "e":
                early = True
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"--runs: {option!r} in {spec!r} is neither pPACE, tOVERLAP nor e") from None
    return mode, pace, tau, early


def median_lag(outer: list[dict]) -> float:
    """Median inner steps between an overlapped outer step's launch and its application (nan: blocking)."""
    lags = sorted(r["applied_after_steps"] for r in outer if "applied_after_steps" in r)
    return lags[len(lags) // 2] if lags else float("nan")


def communication_off(wan: WanTopology, run_dir: Path, names: list[str], config: str, overrides: list[str],
                      steps: int) -> tuple[float, float]:
    """Tokens/s of the same nodes in the same namespaces training alone (no --join): over their inner
    steps, and from step 5 on (past the first steps' warm-up); both up to the step before the last,
    whose record comes after the run's final eval (seconds that, in a pass this short, would make
    communication off read a few percent slow)."""
    solo = LocalCluster(run_dir, config, [*overrides, "--train.max_steps", str(steps)], wan=wan)
    procs = []
    for name in names:
        cmd = [*wan.exec_prefix(name), str(Path(sys.executable).parent / "torchrun"), "--standalone",
               "--nproc-per-node=1", "-m", "prime.train", "--config", config, "--run-dir", str(run_dir / name),
               "--quiet", *overrides, "--train.max_steps", str(steps)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    for p in procs:
        if p.wait(timeout=3600) != 0:
            raise RuntimeError(f"communication off: a node exited with {p.returncode}; its log is under {run_dir}")
    rates = tokens_per_s(solo, names, 0, steps - 1), tokens_per_s(solo, names, 5, steps - 1)
    print(f"communication off: {rates[0]:.0f} tokens/s ({rates[1]:.0f} from step 5)", flush=True)
    return rates


def final_eval(cluster: LocalCluster, name: str) -> float:
    return [r["eval_loss"] for r in cluster.metrics(name) if "eval_loss" in r][-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="example: python launch/bench/utilisation.py --profile global --steps 100")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="global")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--inner-steps", type=int, default=25)
    parser.add_argument("--modes", default="blocking,delayed,streaming",
                        help="diloco.mode values to compare, comma-separated")
    parser.add_argument("--fragments", type=int, default=5, help="streaming: diloco.fragments (must divide H)")
    parser.add_argument("--outer-momentum", type=float, default=None,
                        help="diloco.outer_momentum for every mode (default: the config's)")
    parser.add_argument("--paces", default="0",
                        help="diloco.pace values for delayed and streaming, comma-separated: one run each")
    parser.add_argument("--overlaps", default="0",
                        help="diloco.overlap_steps values for delayed and streaming, comma-separated (0: H for delayed, "
                             "H/F for streaming): one run each")
    parser.add_argument("--runs", default="",
                        help="instead of --modes/--paces/--overlaps, the runs themselves, comma-separated: "
                             "MODE[:pPACE][:tOVERLAP][:e], e.g. blocking,streaming:p0.9,delayed:p0.8:t25,delayed:t20:e "
                             "(e: diloco.apply_early)")
    parser.add_argument("--reference-steps", type=int, default=60,
                        help="inner steps of each communication-off pass: one before every run and one after the last; "
                             "each run is compared with the mean of the two around it")
    parser.add_argument("--config", default="configs/cpu-demo.toml")
    parser.add_argument("--keep", default="", metavar="DIR",
                        help="keep every run's directory (each node's metrics.jsonl and logs, and wire.json: "
                             "the wire samples) under DIR instead of a temporary one")
    args = parser.parse_args()
    try:
        chosen = [run_spec(spec) for spec in args.runs.split(",")] if args.runs else None
    except ValueError as e:
        parser.error(str(e))
    corpus = prepare()
    names = [f"node{i}" for i in range(args.nodes)]
    H = args.inner_steps
    overrides = ["--data.path", str(corpus), "--train.max_steps", str(args.steps), "--diloco.inner_steps",
                 str(H), "--train.eval_every", "0", "--checkpoint.every", "0", "--mesh.transfer_timeout_s", "120"]
    if args.outer_momentum is not None:
        overrides += ["--diloco.outer_momentum", str(args.outer_momentum)]
    steady = (H, args.steps - H)  # from the end of round 1 to the start of the last round
    rows = {}
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        work = contextlib.nullcontext(tempfile.mkdtemp(prefix="utilisation-", dir=args.keep))
    else:
        work = tempfile.TemporaryDirectory()
    with WanTopology(["coordinator", *names], args.profile) as wan, work as tmp:
        if args.keep:
            print(f"run directories under {tmp}", flush=True)
        print(wan.describe(), flush=True)
        refs = [communication_off(wan, Path(tmp) / "solo-0", names, args.config, overrides, args.reference_steps)]
        paces = [float(p) for p in args.paces.split(",")]
        overlaps = [int(t) for t in args.overlaps.split(",")]
        runs = chosen or [(mode, pace, tau, False) for mode in args.modes.split(",")
                          for pace in (paces if mode != "blocking" else [0.0])
                          for tau in (overlaps if mode != "blocking" else [0])]
        for index, (mode, pace, tau, early) in enumerate(runs, 1):
            label = mode if (len(paces) == 1 and not chosen) or mode == "blocking" else f"{mode} p{pace:g}"
            label += f" τ{tau or (H // args.fragments if mode == 'streaming' else H)}" \
                if mode != "blocking" and (len(overlaps) > 1 or chosen) else ""
            label += " early" if early else ""
            extra = ["--diloco.mode", mode, "--diloco.overlap_steps", str(tau)] if mode != "blocking" else []
            extra += ["--diloco.fragments", str(args.fragments)] if mode == "streaming" else []
            extra += ["--diloco.pace", str(pace)] if mode != "blocking" else []
            extra += ["--diloco.apply_early", "true"] if early else []
            run_dir = Path(tmp) / label.replace(" ", "-")
            with LocalCluster(run_dir, args.config, [*overrides, *extra], wan=wan,
                              coordinator_args=["--min-wait-s", "60"]) as c:
                c.start_nodes(names)
                with WireMeter({name: c.nodes[name].pid for name in names}) as meter:
                    c.finish_nodes(names, 3600)
                if args.keep:  # where the peak came from: the samples beside the nodes' metrics
                    (run_dir / "wire.json").write_text(json.dumps(meter.samples))
                outer = list(c.outer_records("node0").values())
                rate = tokens_per_s(c, names)
                steps = [r for r in c.metrics("node0") if "loss" in r]
                step_s = (steps[-1]["time"] - steps[0]["time"]) / (len(steps) - 1)  # wall seconds per inner step
                # Outer steps in flight are decided one after another, so even with τ over H/F each must move
                # within one sync period (H/F steps) to keep up.
                overlap = {"blocking": 0, "delayed": tau or H, "streaming": H // args.fragments}[mode]
                # The run's last outer step is left out: streaming's closes every fragment at once.
                largest = max(r["bytes_sent"] for r in outer[:-1])
                window = (next(r["time"] for r in steps if r["step"] >= steady[0]),
                          next(r["time"] for r in steps if r["step"] >= steady[1]))
                rows[label] = {"rate": rate, "steady": tokens_per_s(c, names, *steady),
                              "share": compute_share(c, names, *steady),
                              "eval": final_eval(c, "node0"), "outer_steps": len(outer),
                              "allreduce_s": sum(r["allreduce_s"] for r in outer),
                              "waited_s": sum(r["outer_s"] for r in outer), "largest_mb": largest / 1e6,
                              "hide_mbit": largest * 8 / 1e6 / (overlap * step_s) if overlap else float("nan"),
                              "peak_mbit": meter.peak_bytes_per_s(1.0, *window) * 8 / 1e6,
                              "mean_mbit": meter.mean_bytes_per_s(*window) * 8 / 1e6,
                              "kernel": f"{sum(1 for r in outer if r.get('kernel_paced'))}/{len(outer)}",
                              "lag": median_lag(outer[:-1])}
            # The reference for this run: communication off just before it and just after it (the machine's
            # speed drifts between passes; the mean of its neighbours cancels a steady drift).
            refs.append(communication_off(wan, Path(tmp) / f"solo-{index}", names, args.config, overrides,
                                          args.reference_steps))
            row = rows[label]
            before, after = refs[-2], refs[-1]
            row["ref"] = ((before[0] + after[0]) / 2, (before[1] + after[1]) / 2)
            row["drift"] = after[1] / before[1] - 1
            print(f"{label}: {row['rate']:.0f} tokens/s, utilisation {row['rate'] / row['ref'][0]:.1%} "
                  f"(steady {row['steady'] / row['ref'][1]:.1%}, inner steps {row['share']:.1%} of the time; "
                  f"communication off before and after it: {before[1]:.0f} and {after[1]:.0f} tokens/s), "
                  f"eval loss {row['eval']:.4f}", flush=True)
    print(f"\n{args.nodes} nodes, {args.config}, H={H}, {args.steps} inner steps, profile {args.profile} "
          f"(backend {wan.backend}); streaming with {args.fragments} fragments; outer momentum "
          f"{args.outer_momentum if args.outer_momentum is not None else 'from the config'}; "
          + (f"runs {args.runs}; " if chosen else f"paces {args.paces}; overlaps {args.overlaps} ")
          + "(τ 0: H for delayed, H/F for streaming); "
          f"steady state = inner steps {steady[0]}-{steady[1]}; communication off: {args.reference_steps} inner steps "
          f"before every run and after the last, {', '.join(f'{r[1]:.0f}' for r in refs)} tokens/s in turn")
    print(f"{'mode':<26}{'util. (run)':>12}{'util. (steady)':>15}{'steps share':>13}{'all-reduce s':>14}{'waited s':>10}"
          f"{'eval loss':>11}{'vs blocking':>13}{'MB/outer step':>15}{'Mbit/s to hide':>16}{'peak Mbit/s':>13}"
          f"{'peak vs blocking':>18}{'mean Mbit/s':>13}{'kernel-paced':>14}{'lag':>6}{'ref drift':>11}")
    base = rows.get("blocking", next(iter(rows.values())))
    for mode, row in rows.items():
        print(f"{mode:<26}{row['rate'] / row['ref'][0]:>12.1%}{row['steady'] / row['ref'][1]:>15.1%}{row['share']:>13.1%}"
              f"{row['allreduce_s']:>14.1f}{row['waited_s']:>10.1f}{row['eval']:>11.4f}"
              f"{row['eval'] / base['eval']:>13.4f}{row['largest_mb']:>15.2f}{row['hide_mbit']:>16.2f}"
              f"{row['peak_mbit']:>13.2f}{row['peak_mbit'] / base['peak_mbit']:>18.3f}{row['mean_mbit']:>13.2f}{row['kernel']:>14}"
              f"{row['lag']:>6g}{row['drift']:>+11.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
