"""Attacks on a running RL cluster, as a token holder and as a stranger, each measured by what it costs
the honest run: trainer steps per minute during the attack over the same run unattacked.

An RL cluster as `make rl-demo` starts it (coordinator with --tls on, orchestrator, trainer, 2 honest
workers; it trains until stopped), then for each attack class a `--window`-second baseline and the
same window under the attack (after a few seconds for it to bite): the run speeds up as it learns
(shorter answers), so each class is held against the baseline measured just before it. The attacker
is an ordinary client with its own worker tokens (a fresh token per class) or none; a stranger's raw
connections come from 127.0.0.2, as from a host of their own (on one loopback address every honest
role would share the attacker's per-address connection cap). Between classes the run is watched: a role that exited counts as a
stop (and is restarted, so the next class meets a running cluster), and every batch's workers are read
back: a rogue token's rollout in a batch counts.

Classes (issue 50's table; the rest of its list is tested in tests/unit, named in the note at the end):
  lease-hog        take every lease it can, never answer                  (1 worker token)
  huge-bodies      60 MB JSON bodies to the orchestrator, 2 connections   (no token)
  idle-flood       1058 idle TCP connections to the orchestrator         (no token)
  forged-tokens    a flood of requests with a forged token                (no token)
  bogus-holder     claim every chunk of each new version, never answer    (1 worker token)
  slow-reader      read from the trainer's chunk server, 2 KiB / 25 ms, 6 streams (1 worker token)
  report-trainer   report the trainer's address for unpublished and published versions, and
                   `have` with its address                                (2 worker tokens)
  submit-flood     submissions for leases it does not hold, as fast as allowed (1 worker token)
  revoked-token    lease on with a token revoked after its first use       (1 worker token)
  stale-garbage    well-formed garbage on leases left to go stale          (1 worker token)
  reroll           take a lease and give it back, over and over            (1 worker token)
  leech            fetch every policy version, serve nothing               (4 worker tokens)
  signed-liar      relay every version corrupted, under its own signature  (1 worker token)

Prints one line per class and ends with

    rl_adversarial: worst <class> at R x baseline, run stopped N times, rogue rollouts in batches M
"""

from __future__ import annotations

import argparse
import shutil
import socket
import ssl
import sys
import time
from pathlib import Path

from elastic_mesh import BroadcastMember, CoordinatorClient, CoordinatorError
from launch.bench.rl_attacks import ATTACKS, STRANGER
from launch.cluster import wait_for
from launch.rl_cluster import RLCluster, new_policy

HONEST = ("worker-a", "worker-b")


class Bench:
    def __init__(self, run_dir: Path, window_s: float) -> None:
        self.run_dir, self.window_s = run_dir, window_s
        policy = new_policy(run_dir / "policy")
        self.cluster = RLCluster(run_dir, policy, tls=True,
                                 orchestrator_sets=["async_level=2", "seed=0"], trainer_sets=["max_steps=100000"])
        self.stops = 0
        self.trainer_token = ""
        self._tls: ssl.SSLContext | None = None

    def orchestrator_client(self, token: str) -> CoordinatorClient:
        return CoordinatorClient(self.cluster.orchestrator_address, request_timeout_s=15, retry_s=15, bearer=token,
                                 tls=self._tls)

    def raw_connection(self) -> socket.socket:
        host, port = self.cluster.orchestrator_address.rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=10, source_address=(STRANGER, 0))
        return self._tls.wrap_socket(s, server_hostname=host) if self._tls is not None else s

    def newest_version(self) -> int:
        """The newest policy version the orchestrator holds."""
        return int(self.status()["newest"])

    def origin_address(self, member: BroadcastMember, version: int) -> str:
        holders = member.client.post("/v1/broadcast/holders", {"kind": "policy", "version": version})["holders"]
        return next(h["address"] for h in holders if h["origin"])

    def status(self) -> dict:
        return self.orchestrator_client(self.trainer_token).post("/v1/rl/status", {})

    def rate(self, seconds: float) -> float:
        """Trainer steps per minute over the next `seconds`."""
        first, began = self.status()["next_step"], time.monotonic()
        time.sleep(seconds)
        return (self.status()["next_step"] - first) * 60 / (time.monotonic() - began)

    def heal(self) -> None:
        """Restarts any role that exited: each counts as a stop of the run."""
        if self.cluster.procs["coordinator"].poll() is not None:
            raise SystemExit("rl_adversarial: the coordinator exited: the run cannot go on")
        for name in ("orchestrator", "trainer", *HONEST):
            proc = self.cluster.procs[name]
            if proc.poll() is not None:
                self.stops += 1
                print(f"rl_adversarial: {name} exited with {proc.returncode}; restarting it", flush=True)
                if name == "orchestrator":
                    self.cluster.start_orchestrator()
                elif name == "trainer":
                    self.cluster.start_trainer()
                else:
                    self.cluster.start_worker(name)

    def rogue_rollouts(self, rogues: set[str]) -> int:
        return sum(n for b in self.cluster.events("batch") for w, n in (b.get("workers") or {}).items() if w in rogues)

    def run(self, names: list[str]) -> int:
        results: list[tuple[str, float]] = []
        rogues: set[str] = set()
        with self.cluster:
            self.cluster.start(list(HONEST))
            self.trainer_token = self.cluster.token("trainer", publish=True).read_text()
            self._tls = CoordinatorClient.for_token(self.trainer_token, bearer=True).tls_context()
            wait_for(lambda: self.status()["next_step"] >= 5, 300, "five trainer steps")
            print(f"rl_adversarial: TLS {'on' if self._tls else 'off'}, {len(HONEST)} honest workers, "
                  f"{self.window_s:.0f} s windows", flush=True)
            for attack_class in [a for a in ATTACKS if a.name in names]:
                baseline = self.rate(self.window_s)
                attack = attack_class(self)
                attack.start()
                time.sleep(3)  # time to bite
                try:
                    during = self.rate(self.window_s)
                except CoordinatorError as e:
                    during = 0.0
                    print(f"rl_adversarial: {attack.name}: the orchestrator did not answer: {e}", flush=True)
                detail = attack.detail()
                attack.stop()
                rogues.update(attack.tokens)
                results.append((attack.name, during / baseline if baseline else 0.0))
                print(f"rl_adversarial: {attack.name:15s} {during:6.1f} steps/min against {baseline:6.1f} just before "
                      f"= {results[-1][1]:.2f} x baseline" + (f"; {detail}" if detail else ""), flush=True)
                time.sleep(3)
                self.heal()
            rogue_rows = self.rogue_rollouts(rogues)
        worst = min(results, key=lambda r: r[1])
        print(f"rl_adversarial: worst {worst[0]} at {worst[1]:.2f} x baseline, run stopped {self.stops} times, "
              f"rogue rollouts in batches {rogue_rows}")
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, default=Path("runs/bench-rl-adversarial"), help="emptied first")
    parser.add_argument("--window", type=float, default=30.0, help="seconds each rate is measured over (default 30)")
    parser.add_argument("--attacks", default=",".join(a.name for a in ATTACKS),
                        help="comma-separated classes (default: all)")
    args = parser.parse_args(argv)
    names = [n for n in args.attacks.split(",") if n]
    unknown = set(names) - {a.name for a in ATTACKS}
    if unknown:
        parser.error(f"unknown attack classes {sorted(unknown)}; known: {[a.name for a in ATTACKS]}")
    shutil.rmtree(args.run_dir, ignore_errors=True)
    args.run_dir.mkdir(parents=True)
    return Bench(args.run_dir, args.window).run(names)


if __name__ == "__main__":
    sys.exit(main())
