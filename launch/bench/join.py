"""Benchmark: how fast a node joins a running job over a rate-limited link, and what it costs the others.

S source nodes train (pinned to core 0) behind links of --up-mbit upload each; a joiner (pinned to
core 1 with the user-space link emulator, --down-mbit download) starts mid-run. It fetches the snapshot of the last committed step
from all S sources at once, waits for the next commit, replays it, and enters the following round.
Printed per S: snapshot bytes, download time against bytes / min(S × up, down), catch-up time against
its lower bound (download at link rate + the rest of the round it arrived in), time to its first
contribution, the outer steps it was left out of after catching up (it must then catch up again), and
the sources' tokens/s during the join against the same span just before it.

    python launch/bench/join.py [--sources 1 3] [--up-mbit 20] [--down-mbit 100] [--latency-ms 20]
                                [--mode streaming --fragments 5]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch.cluster import LocalCluster, wait_for
from launch.wan.harness import LinkProfile, WanTopology
from prime.data.builtin_corpus import prepare

MODEL = ["--model.hidden_size", "256", "--model.intermediate_size", "768", "--model.num_layers", "4",
         "--model.num_heads", "4", "--model.num_kv_heads", "2"]



def trial(sources: int, args, corpus: Path) -> dict:
    names = [f"source{i}" for i in range(sources)]
    up = LinkProfile(latency_ms=args.latency_ms, up_mbit=args.up_mbit, down_mbit=args.down_mbit)
    overrides = ["--data.path", str(corpus), "--train.max_steps", "100000", "--diloco.inner_steps", "10",
                 "--train.eval_every", "0", "--checkpoint.every", "0", "--chaos.step_delay_s", "0.6",
                 "--mesh.transfer_timeout_s", "120", "--train.log_every", "1000", *MODEL,
                 "--diloco.mode", args.mode, "--diloco.fragments", str(args.fragments)]
    work = (contextlib.nullcontext(tempfile.mkdtemp(prefix=f"join-{sources}-", dir=args.keep)) if args.keep
            else tempfile.TemporaryDirectory())
    with WanTopology(["coordinator", *names, "joiner"], up) as wan, work as tmp:
        if wan._emulator is not None:  # the user-space link emulator is the harness's cost, not the sources'
            subprocess.run(["taskset", "-a", "-p", "-c", "1", str(wan._emulator.pid)], check=True,
                           capture_output=True)
        with LocalCluster(Path(tmp), "configs/debug.toml", overrides, wan=wan,
                          coordinator_args=["--lease-s", "10", "--min-wait-s", "5", "--tls", args.tls]) as c:
            c.start_coordinator(start_nodes=sources)
            for name in names:
                c.start_node(name, cpus="0")
            wait_for(lambda: len(c.outer_records(names[0])) >= 3, 600, "three outer steps")
            started = time.time()
            c.start_node("joiner", ["--diloco.take_peer_moments", str(args.moments == "peers").lower()], cpus="1")
            caught = wait_for(lambda: [r for r in c.metrics("joiner") if "caught_up_to" in r], 600, "the catch-up")[0]
            first = wait_for(lambda: c.outer_records("joiner"), 600, "the joiner's first outer step")
            # Its first two rounds as a member: the loss right after joining, against the others'.
            wait_for(lambda: len(c.outer_records("joiner")) >= 2, 600, "the joiner's second outer step")
            joiner_loss = {r["step"]: r["loss"] for r in c.metrics("joiner") if "loss" in r}
            catch_ups = [r for r in c.metrics("joiner") if "caught_up_to" in r]
            log = c.log("joiner")
            steps = [r for r in c.metrics(names[0]) if "loss" in r]
            sources_loss = [{r["step"]: r["loss"] for r in c.metrics(n) if "loss" in r} for n in names]
            c.stop()
        backend = wan.backend
    admitted = _admitted_time(log, started)
    link_mbit = min(sources * args.up_mbit, args.down_mbit)
    bytes_ = caught["snapshot_bytes"]
    ideal_download = bytes_ * 8 / (link_mbit * 1e6)
    span = caught["time"] - admitted
    during = [r["tokens_per_s"] for r in steps if admitted <= r["time"] <= caught["time"]]
    before = [r["tokens_per_s"] for r in steps if admitted - span <= r["time"] < admitted]
    first_step = min(first)
    others_loss = {r["step"]: r["loss"] for r in steps}
    window = [s for s in sorted(joiner_loss) if s in others_loss][:20]  # two rounds of H=10 inner steps
    loss_ratio = (statistics.mean(joiner_loss[s] for s in window) / statistics.mean(others_loss[s] for s in window)
                  if window else float("nan"))
    # The same measure between the sources themselves (same model, each its own data): how far apart two
    # members' losses are anyway, the yardstick for the joiner's.
    means = [statistics.mean(losses[s] for s in window) for losses in sources_loss if all(s in losses for s in window)]
    spread = max(means) / min(means) if len(means) > 1 and window else float("nan")
    return {"loss_ratio": loss_ratio, "sources_spread": spread, "moments_step": caught.get("moments_step"),
            "snapshot_step": caught["caught_up_to"] - caught["replayed"],"sources": sources, "backend": backend, "snapshot_mb": bytes_ / 1e6, "download_s": caught["download_s"],
            "ideal_download_s": ideal_download, "catch_up_s": caught["catch_up_s"],
            "first_contribution_s": first[first_step]["time"] - admitted, "replayed": caught["replayed"],
            # Each step between its first catch-up and its first contribution is one it was left out of.
            "left_out": first_step - caught["caught_up_to"] - 1, "catch_ups": len(catch_ups),
            "others_ratio": statistics.median(during) / statistics.median(before) if during and before else float("nan"),
            "samples": (len(before), len(during)), "process_start_s": admitted - started}


def _admitted_time(log: str, fallback: float) -> float:
    """Wall time of the joiner's 'joined run' line (after Python, torch and the model are up)."""
    import datetime

    for line in log.splitlines():
        if "joined run" in line:
            hh, mm, ss = (int(x) for x in line.split()[0].split(":"))
            day = datetime.datetime.fromtimestamp(fallback)
            return day.replace(hour=hh, minute=mm, second=ss, microsecond=0).timestamp()
    return fallback


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="example: python launch/bench/join.py --sources 1 3 --up-mbit 20")
    parser.add_argument("--sources", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--up-mbit", type=float, default=20.0)
    parser.add_argument("--down-mbit", type=float, default=100.0)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--mode", choices=["blocking", "delayed", "streaming"], default="blocking",
                        help="diloco.mode of every node")
    parser.add_argument("--fragments", type=int, default=5, help="diloco.fragments (streaming)")
    parser.add_argument("--tls", choices=["auto", "on", "off"], default="auto",
                        help="the coordinator's --tls (auto: on, the emulated hosts are not loopback)")
    parser.add_argument("--moments", choices=["peers", "fresh"], default="fresh",
                        help="the joiner takes its peers' AdamW moments (diloco.take_peer_moments) or starts AdamW "
                             "afresh (the default, as nodes do)")
    parser.add_argument("--repeats", type=int, default=1, help="trials per number of sources")
    parser.add_argument("--keep", default="", metavar="DIR", help="keep each trial's run directory (logs, metrics) under DIR")
    args = parser.parse_args()
    corpus = prepare()
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    rows = [trial(s, args, corpus) for s in args.sources for _ in range(args.repeats)]
    print(f"join over links of {args.up_mbit:g} Mbit/s up per source, {args.down_mbit:g} Mbit/s down at the joiner, "
          f"{args.latency_ms:g} ms one way, mode {args.mode} (backend {rows[0]['backend']}), TLS {args.tls}, "
          f"joiner's moments: {args.moments}")
    print(f"{'sources':>7} {'snapshot MB':>11} {'download s':>10} {'at link rate s':>14} {'catch-up s':>10} "
          f"{'first contribution s':>20} {'replayed':>8} {'left out':>8} {'catch-ups':>9} "
          f"{'others tok/s during/before':>26} {'moments/snapshot step':>21} {'loss after join / others':>24} "
          f"{'sources max/min':>15}")
    for r in rows:
        print(f"{r['sources']:>7} {r['snapshot_mb']:>11.1f} {r['download_s']:>10.2f} {r['ideal_download_s']:>14.2f} "
              f"{r['catch_up_s']:>10.2f} {r['first_contribution_s']:>20.1f} {r['replayed']:>8} "
              f"{r['left_out']:>8} {r['catch_ups']:>9} {r['others_ratio']:>26.3f} "
              f"{str(r['moments_step']) + '/' + str(r['snapshot_step']):>21} {r['loss_ratio']:>24.3f} "
              f"{r['sources_spread']:>15.3f}")
    print("catch-up = download + wait for the round in flight to commit + replay; times from the joiner's admission; "
          "loss after join: the joiner's mean loss over its first 20 inner steps as a member / a source's at the same "
          "steps; sources max/min: the same measure between the sources' own losses")
    return 0


if __name__ == "__main__":
    sys.exit(main())
