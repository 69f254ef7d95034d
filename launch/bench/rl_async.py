"""Benchmark: asynchronous GRPO at async levels 0, 1, 2 and 4 under an emulated WAN where moving a
policy version takes about as long as a training step. Same seed, same wall-clock budget per level.

Every role is its own process in its own network namespace (launch/wan/harness.py: netem where the
kernel has it, else the user-space TUN emulator; the output says which), every host behind the same
access link (--latency-ms one way, --mbit up and down). Each level starts afresh from the same fresh
policy (thresholds measured once per seed) and runs until the held-out reward reaches 0.95 or
--budget-s passes. With several --seeds (each the policy's initialisation, the task stream and the
sampling seeds, the same for every level) every level runs once per seed and the last line reports each
level's median over the seeds: one run's versions to 0.9 spreads ±30% with the seed (async 0 is
deterministic given its seed: seed 0 needs 165 versions, seed 1 230). Reported per level: time to
held-out reward 0.9, trainer idle fraction, worker idle fraction, how busy the machine's CPUs were,
mean and max staleness of the batches, final held-out reward, the trainer's mean step time, the
workers' mean time to fetch a version and when a version was announced, fetched and usable at them,
and the rollouts rejected (every worker here is honest: a rejection or eviction is a verifier bug).
A PNG of reward against time. Last line:

    rl_async: time to reward 0.9 — async0 <s>, async1 <s>, async2 <s>, async4 <s>; trainer idle async0 <x>%, async2 <y>%

    sudo python launch/bench/rl_async.py [--levels 0,1,2,4] [--seeds 0] [--budget-s 300] [--latency-ms 10] [--mbit 50]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from launch.rl_cluster import RLCluster, new_policy
from launch.wan.harness import LinkProfile, WanTopology

WORKERS = ["worker-a", "worker-b"]
# Per batch, from the orchestrator (medians over its groups): lease -> rollouts arrived, arrived -> verified,
# verified -> batched, and the trainer's (prefetching) request -> built.
BATCH_PATH = ("leased_to_arrived_s", "arrived_to_verified_s", "verified_to_batch_s", "asked_to_built_s")


def run_level(level: int, policy: Path, out: Path, link: LinkProfile, budget_s: float, seed: int,
              publish_dtype: str, prompts_per_lease: int, trusted_together: bool = False, in_flight: int = 2,
              trainer_sets: list[str] | None = None, niceness: dict[str, int] | None = None) -> dict:
    # trusted_together: the trainer and the orchestrator on one host (one datacenter behind one access link);
    # otherwise each behind its own, as every other role.
    placement = {"trainer": "trusted", "orchestrator": "trusted"} if trusted_together else {}
    hosts = ["coordinator", *(["trusted"] if trusted_together else ["orchestrator", "trainer"]), *WORKERS]
    with WanTopology(hosts, link) as wan:
        cluster = RLCluster(out, policy, wan=wan, placement=placement, orchestrator_sets=[
            f"async_level={level}", "stop_at_reward=0.95", f"seed={seed}", "eval_every=5", "lease_s=60",
            f"prompts_per_lease={prompts_per_lease}"],
            trainer_sets=["max_steps=2000", f"publish_dtype={publish_dtype}", *(trainer_sets or [])],
            worker_args=["--in_flight", str(in_flight)], niceness=niceness)
        with cluster:
            cluster.start(WORKERS)
            started, cpu_before = time.monotonic(), _cpu_times()
            pids = {name: proc.pid for name, proc in cluster.procs.items()}
            if wan.emulator_pid is not None:
                pids["emulator"] = wan.emulator_pid
            role_cpu: dict[str, float] = {}
            while cluster.procs["orchestrator"].poll() is None and time.monotonic() - started < budget_s:
                role_cpu.update(_process_cpu_s(pids))  # the last reading before each exits
                time.sleep(1.0)
            cpu_busy = _busy_fraction(cpu_before, _cpu_times())
            timed_out = cluster.procs["orchestrator"].poll() is None
            if not timed_out:
                for name in WORKERS:
                    cluster.wait(name, 60)
        backend = wan.backend
    evals, batches, trainer = cluster.events("eval"), cluster.events("batch"), cluster.trainer_records()
    reached = next((e["time_s"] for e in evals if e["eval_reward"] >= 0.9), None)
    workers = [json.loads((out / n / "worker.json").read_text()) for n in WORKERS if (out / n / "worker.json").exists()]
    fetches = [float(m) for n in WORKERS for m in re.findall(r"fetched in ([0-9.]+) s", cluster.log(n))]
    return {"level": level, "backend": backend, "time_to_0.9_s": reached, "timed_out": timed_out,
            "final_reward": evals[-1]["eval_reward"] if evals else None, "versions": len(trainer),
            "trainer_idle": trainer[-1]["idle_fraction"] if trainer else None, "cpu_busy": cpu_busy,
            "worker_idle": 1 - sum(w["busy_s"] for w in workers) / max(sum(w["seconds"] for w in workers), 1e-9)
            if workers else None,
            "staleness_mean": sum(b["staleness_mean"] for b in batches) / max(len(batches), 1),
            "staleness_max": max((b["staleness_max"] for b in batches), default=0),
            "train_step_s": sum(r["train_s"] for r in trainer) / max(len(trainer), 1),
            "rollouts_stale": batches[-1]["rollouts_stale"] if batches else 0,
            # Every worker here is honest: a rejected rollout or an evicted worker is a verifier bug.
            "rollouts_rejected": batches[-1]["rollouts_rejected"] if batches else 0,
            "evictions": re.findall(r"evicted: (.*)", cluster.log("orchestrator")),
            "fetch_s": sum(fetches) / len(fetches) if fetches else None,
            **_version_path(trainer, cluster.events("version"), workers),
            "worker_time": {k: round(sum(w.get(k, 0.0) for w in workers) / max(sum(w["seconds"] for w in workers), 1e-9), 3)
                            for k in ("busy_s", "lease_s", "waiting_s", "submit_s", "fetching_s")},
            "cpu_s_per_version": {name: round(seconds / max(len(trainer), 1), 3) for name, seconds in role_cpu.items()},
            "trainer_time": {k: round(_mean(r.get(k) for r in trainer), 4) for k in ("update_s", "save_s", "publish_s")},
            "batch_path": {k: round(_mean(b.get(k) for b in batches), 3) for k in BATCH_PATH},
            "evals": [(e["time_s"], e["eval_reward"]) for e in evals],
            "eval_versions": [(e["version"], e["eval_reward"]) for e in evals]}


def _cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies of this machine's CPUs since boot, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + fields[4], sum(fields[:8])  # idle + iowait; user .. steal


def _process_cpu_s(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) each running process has used so far, from /proc/<pid>/stat."""
    tick, seconds = os.sysconf("SC_CLK_TCK"), {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited: its last reading stands
        seconds[name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15 of stat(5))
    return seconds


def _busy_fraction(before: tuple[int, int], after: tuple[int, int]) -> float:
    """How busy every CPU of the machine was between two _cpu_times() (every process, not only the run's)."""
    total = after[1] - before[1]
    return round(1 - (after[0] - before[0]) / total, 3) if total > 0 else 0.0


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


def _version_path(trainer: list[dict], loaded: list[dict], workers: list[dict]) -> dict:
    """How long a version took from the trainer's publish to usable at the orchestrator (it verifies
    against it) and at the workers (they generate with it), median over versions, wall clock."""
    published = {r["step"]: r["published_at"] for r in trainer if "published_at" in r}

    def median_lag(at: dict[int, float]) -> float | None:
        lags = sorted(t - published[v] for v, t in at.items() if v in published)
        return round(lags[len(lags) // 2], 3) if lags else None

    def median_each(name: str) -> float | None:  # over every (worker, version)
        lags = sorted(t - published[int(v)] for w in workers for v, t in w.get(name, {}).items()
                      if int(v) in published)
        return round(lags[len(lags) // 2], 3) if lags else None
    return {"announced_at_workers_s": median_each("announced_at"), "fetched_at_workers_s": median_each("fetched_at"),
            "usable_at_workers_s": median_each("loaded_at"),
            "to_orchestrator_s": median_lag({e["version"]: e["loaded_at"] for e in loaded if "loaded_at" in e}),
            "to_workers_s": median_lag({int(v): max(w["loaded_at"][v] for w in workers if v in w.get("loaded_at", {}))
                                        for v in set().union(*(w.get("loaded_at", {}) for w in workers))})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="0,1,2,4", help="async levels to run (default 0,1,2,4)")
    parser.add_argument("--budget-s", type=float, default=300, help="wall-clock budget per level (default 300)")
    parser.add_argument("--latency-ms", type=float, default=10, help="one-way latency of every access link "
                        "(default 10: 40 ms round trip between two hosts)")
    parser.add_argument("--mbit", type=float, default=50, help="rate of every access link, each direction (default "
                        "50: a 1.2 MB version in ~0.2 s plus round trips, about one training step here)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds, one run per level each (default 0); "
                        "with several, the last line gives each level's median over them")
    parser.add_argument("--publish-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the precision policy versions travel in (the trainer's publish_dtype; default "
                        "float32, as the trainer's)")
    parser.add_argument("--prompts-per-lease", type=int, default=8,
                        help="prompts in one worker lease (the orchestrator's prompts_per_lease; default 8)")
    parser.add_argument("--in-flight", type=int, default=2,
                        help="submissions a worker keeps awaiting verification (its --in-flight; default 2)")
    parser.add_argument("--trusted-together", action="store_true",
                        help="run the trainer and the orchestrator on one host behind one access link (both "
                        "trusted: one datacenter); default: each behind its own, like every other role")
    parser.add_argument("--trainer-set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a trainer config field at every level (e.g. grpo.decoupled=false)")
    parser.add_argument("--nice", action="append", default=[], metavar="ROLE=N",
                        help="run a role (coordinator, orchestrator, trainer, worker-a, worker-b) at CPU niceness N "
                        "(0-19), at every level: every role shares this machine's cores, where a deployment gives "
                        "each its own machine (default: all at 0)")
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default a temporary folder)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds takes comma-separated integers, not {args.seeds!r}")
    roles = {"coordinator", "orchestrator", "trainer", *WORKERS}
    niceness = {}
    for setting in args.nice:
        role, _, value = setting.partition("=")
        if role not in roles or not value.isdigit() or not 0 <= int(value) <= 19:
            parser.error(f"--nice takes ROLE=N with ROLE one of {', '.join(sorted(roles))} and N 0-19, not {setting!r}")
        niceness[role] = int(value)
    root = args.out or Path(tempfile.mkdtemp(prefix="rl-async-"))
    root.mkdir(parents=True, exist_ok=True)
    link = LinkProfile(latency_ms=args.latency_ms, up_mbit=args.mbit, down_mbit=args.mbit)
    results = []
    for seed in seeds:
        policy = new_policy(root / f"seed{seed}" / "policy", seed=seed)
        for level in levels:
            out = root / f"seed{seed}" / f"async{level}"
            shutil.rmtree(out, ignore_errors=True)
            result = {"seed": seed, **run_level(level, policy, out, link, args.budget_s, seed, args.publish_dtype,
                                                args.prompts_per_lease, args.trusted_together, args.in_flight,
                                                args.trainer_set, niceness)}
            results.append(result)
            _report(result, args, len(seeds) > 1, niceness)
            if args.json:  # after every run: a long sweep stopped early keeps what it measured
                args.json.write_text(json.dumps(results, indent=1))
    _plot(results, root / "rl_async.png")
    print(f"plot {root / 'rl_async.png'}")
    medians = {level: _medians([r for r in results if r["level"] == level]) for level in levels}
    if len(seeds) > 1:
        _summarise(results, medians, levels, seeds)
    times = ", ".join(f"async{lv} {_s(medians[lv]['time_to_0.9_s'])}" for lv in levels)
    idle = ", ".join(f"async{lv} {_pct(medians[lv]['trainer_idle'])}" for lv in (0, 2) if lv in medians)
    print(f"rl_async: time to reward 0.9 — {times}; trainer idle {idle}")
    return 0


def _report(result: dict, args: argparse.Namespace, several_seeds: bool, niceness: dict[str, int]) -> None:
    level = result["level"]
    print(f"async{level}" + (f" seed {result['seed']}" if several_seeds else "")
          + f" ({result['backend']}, {args.latency_ms:g} ms one way, {args.mbit:g} Mbit/s, "
          + ("trainer and orchestrator on one host, " if args.trusted_together else "")
          + "".join(f"{role} at nice {n}, " for role, n in sorted(niceness.items())) +
          f"versions in {args.publish_dtype}): "
          f"reward 0.9 at {_s(result['time_to_0.9_s'])}, final {result['final_reward']}, "
          f"{result['versions']} versions, trainer idle {_pct(result['trainer_idle'])}, worker idle "
          f"{_pct(result['worker_idle'])}, CPUs busy {_pct(result['cpu_busy'])}, staleness mean "
          f"{result['staleness_mean']:.2f} max "
          f"{result['staleness_max']}, train step {result['train_step_s']:.3f} s, version fetch "
          f"{_s(result['fetch_s'], 2)}, stale rollouts {result['rollouts_stale']}, rejected rollouts "
          f"{result['rollouts_rejected']}", flush=True)
    for reason in result["evictions"]:
        print(f"  an honest worker was evicted (a verifier bug): {reason}", flush=True)
    print(f"  a version's way: published -> usable at the orchestrator {_s(result['to_orchestrator_s'], 2)}, at "
          f"both workers {_s(result['to_workers_s'], 2)} (median; at a worker: announced "
          f"{_s(result['announced_at_workers_s'], 2)}, fetched {_s(result['fetched_at_workers_s'], 2)}, usable "
          f"{_s(result['usable_at_workers_s'], 2)}); trainer per step: "
          + ", ".join(f"{k.removesuffix('_s')} {v:.3f} s" for k, v in result["trainer_time"].items())
          + "; workers' time: " + ", ".join(f"{k.removesuffix('_s')} {100 * v:.0f}%"
                                           for k, v in result["worker_time"].items()), flush=True)
    print("  CPU seconds per version: " + ", ".join(f"{name} {v:.3f}" for name, v in
                                                     result["cpu_s_per_version"].items()), flush=True)
    print("  a batch's groups (mean over batches): " + ", ".join(
        f"{k.removesuffix('_s').replace('_', ' ')} {_s(v, 3)} s" for k, v in result["batch_path"].items()), flush=True)


def _medians(runs: list[dict]) -> dict:
    """A level's median time to 0.9 and trainer idle over its seeds. A run that did not reach 0.9 counts
    as slower than any that did: a median that falls on such runs is None (not reached)."""
    times = statistics.median(math.inf if r["time_to_0.9_s"] is None else r["time_to_0.9_s"] for r in runs)
    idles = [r["trainer_idle"] for r in runs if r["trainer_idle"] is not None]
    return {"time_to_0.9_s": None if math.isinf(times) else times,
            "trainer_idle": statistics.median(idles) if idles else None}


def _summarise(results: list[dict], medians: dict, levels: list[int], seeds: list[int]) -> None:
    """Per level, every seed's time to 0.9, versions and trainer idle, their medians, and each level's time
    as a fraction of async 0's on the same seed."""
    run = {(r["level"], r["seed"]): r for r in results}
    print(f"\n| async level | time to 0.9, seeds {', '.join(map(str, seeds))} | median | versions to 0.9 | "
          f"trainer idle | median idle | × async 0, per seed |")
    print("|---|---|---|---|---|---|---|")
    for level in levels:
        rows = [run[(level, s)] for s in seeds]
        ratios = []
        for r in rows:
            base = run.get((0, r["seed"]))
            both = base is not None and None not in (r["time_to_0.9_s"], base["time_to_0.9_s"])
            ratios.append(f"{r['time_to_0.9_s'] / base['time_to_0.9_s']:.2f}" if both else "n/a")
        print(f"| {level} | {', '.join(_s(r['time_to_0.9_s']) for r in rows)} | "
              f"{_s(medians[level]['time_to_0.9_s'])} | {', '.join(str(_versions_to(r)) for r in rows)} | "
              f"{', '.join(_pct(r['trainer_idle']) for r in rows)} | {_pct(medians[level]['trainer_idle'])} | "
              f"{', '.join(ratios)} |")
    print(f"(medians over seeds {', '.join(map(str, seeds))})")


def _versions_to(result: dict) -> int | str:
    """The policy version whose held-out eval first reached 0.9 ("n/a" if none did)."""
    return next((v for v, reward in result.get("eval_versions", []) if reward >= 0.9), "n/a")


def _s(value, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def _plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(6, 4))
    seeds = sorted({r["seed"] for r in results})
    colours = {level: f"C{i}" for i, level in enumerate(sorted({r["level"] for r in results}))}
    styles = ["-", "--", ":", "-."]
    for r in results:
        if r["evals"]:
            label = f"async {r['level']}" + (f", seed {r['seed']}" if len(seeds) > 1 else "")
            axis.plot(*zip(*r["evals"]), marker=".", color=colours[r["level"]],
                      linestyle=styles[seeds.index(r["seed"]) % len(styles)], label=label)
    axis.set_xlabel("seconds since the orchestrator started")
    axis.set_ylabel("held-out reward (greedy)")
    axis.grid(alpha=0.3)
    axis.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
