"""Benchmark: what a joiner costs the nodes already training, round by round.

S source nodes train the debug model on loopback (H inner steps, each slowed so the run keeps going);
once `--after` outer steps are committed every source starts serving its chunks slowly (--serve-delay-s
per chunk: slow uplinks), and a joiner starts. It downloads the snapshot from the sources, catches up
and joins. Printed per trial: the joiner's download and catch-up time, then for the sources every
round's plan time (the barrier: what the others waited for before the transfer) and whole round time,
the round the joiner entered marked, and an ordinary round's period (inner steps included): a joiner
must not cost the others more than one ordinary round.

    python launch/bench/join_cost.py [--sources 3] [--serve-delay-s 0.3] [--repeats 2] [--keep DIR]

Last line: `join_cost: joiner's first round plan <p> s (others' median <m> s; an ordinary round <r> s),
download <d> s, catch-up <c> s` (the worst trial's)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

from launch.cluster import LocalCluster, wait_for
from prime.data.builtin_corpus import prepare


def trial(args, corpus: Path) -> dict:
    names = [f"source{i}" for i in range(args.sources)]
    overrides = ["--data.path", str(corpus), "--train.max_steps", str(args.inner_steps * args.rounds),
                 "--diloco.inner_steps", str(args.inner_steps), "--train.eval_every", "0", "--checkpoint.every", "0",
                 "--train.log_every", "1000", "--diloco.mode", args.mode,
                 "--mesh.chunk_bytes", str(args.chunk_kib << 10)]
    work = (contextlib.nullcontext(tempfile.mkdtemp(prefix="join-cost-", dir=args.keep)) if args.keep
            else tempfile.TemporaryDirectory())
    with work as tmp, LocalCluster(Path(tmp), "configs/debug.toml", overrides,
                                   coordinator_args=["--tls", args.tls]) as c:
        c.start_coordinator(start_nodes=args.sources)
        controls = {}
        for name in names:
            controls[name] = Path(tmp) / f"control-{name}"
            controls[name].mkdir()
            c.start_node(name, ["--chaos.step_delay_s", str(args.step_delay_s),
                                "--chaos.control_dir", str(controls[name])])
        wait_for(lambda: len(c.outer_records(names[0])) >= args.after, 600, f"{args.after} outer steps")
        for name in names:  # every source serves slowly from now on
            (controls[name] / "slow-serving").write_text(str(args.serve_delay_s))
        time.sleep(2 * args.step_delay_s)  # taken at the sources' next inner step
        c.start_node("joiner")
        caught = wait_for(lambda: [r for r in c.metrics("joiner") if "caught_up_to" in r], 600, "the catch-up")[0]
        first = min(wait_for(lambda: c.outer_records("joiner"), 600, "the joiner's first outer step"))
        last = min(first + 2, args.rounds)  # the run may end sooner: the joiner's start is not timed
        wait_for(lambda: max(c.outer_records(names[0]), default=0) >= last, 600, "two more outer steps")
        rounds = c.outer_records(names[0])
        c.stop()  # the rest of the run is not measured
    plans = {k: r["timings"]["plan_s"] for k, r in rounds.items()}
    times = [rounds[k]["time"] for k in sorted(rounds)]
    period = statistics.median(b - a for a, b in zip(times, times[1:]))  # an ordinary round, inner steps included
    outers = {k: r["outer_s"] for k, r in rounds.items()}
    ordinary = [plans[k] for k in plans if k > 1 and k not in (first, first - 1)]
    return {"first": first, "plans": plans, "outers": outers, "download_s": caught["download_s"],
            "catch_up_s": caught["catch_up_s"], "caught_up_to": caught["caught_up_to"],
            "first_plan_s": plans[first], "median_plan_s": statistics.median(ordinary) if ordinary else float("nan"),
            "first_outer_s": outers[first], "period_s": period,
            "median_outer_s": statistics.median(outers[k] for k in outers if k > 1 and k != first)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="example: python launch/bench/join_cost.py --sources 3 --repeats 2")
    parser.add_argument("--sources", type=int, default=3)
    parser.add_argument("--after", type=int, default=3, help="outer steps committed before the joiner starts")
    parser.add_argument("--rounds", type=int, default=40, help="outer steps of the run (it ends when the joiner "
                        "has taken part in two)")
    parser.add_argument("--inner-steps", type=int, default=5)
    parser.add_argument("--step-delay-s", type=float, default=0.2, help="added to every inner step of a source")
    parser.add_argument("--serve-delay-s", type=float, default=0.3, help="each chunk a source serves, this late")
    parser.add_argument("--chunk-kib", type=int, default=64, help="snapshot chunk size (the debug model: ~1 MB)")
    parser.add_argument("--mode", choices=["blocking", "delayed", "streaming"], default="blocking")
    parser.add_argument("--tls", choices=["on", "off"], default="on", help="the coordinator's --tls (on: as across "
                        "machines; every snapshot server speaks it too)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--keep", default="", metavar="DIR", help="keep each trial's run directory under DIR")
    args = parser.parse_args()
    corpus = prepare()
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    rows = [trial(args, corpus) for _ in range(args.repeats)]
    for r in rows:
        print(f"joiner caught up to {r['caught_up_to']} (download {r['download_s']:.2f} s, catch-up "
              f"{r['catch_up_s']:.2f} s), first round {r['first']}")
        print("  round  plan_s  outer_s")
        for k in sorted(r["plans"]):
            mark = "  <- the joiner's first" if k == r["first"] else ""
            print(f"  {k:5d}  {r['plans'][k]:6.2f}  {r['outers'][k]:7.2f}{mark}")
    worst = max(rows, key=lambda r: r["first_plan_s"])
    print(f"join_cost: joiner's first round plan {worst['first_plan_s']:.2f} s (others' median "
          f"{worst['median_plan_s']:.2f} s; an ordinary round {worst['period_s']:.2f} s), download "
          f"{worst['download_s']:.2f} s, catch-up {worst['catch_up_s']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
