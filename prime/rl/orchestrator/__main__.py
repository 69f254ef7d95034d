"""The orchestrator process: hands out prompt leases, verifies and scores rollouts, builds batches.

    python -m prime.rl.orchestrator --token-file orch.token --run-dir runs/rl/orchestrator [--set async_level=2]

It follows the policy broadcast with its token (any role), serves workers and the trainer on --port, serves
a dashboard at / to any token of the run (rollouts/s, reward, staleness, each worker's verified and rejected
rollouts), and writes metrics.jsonl (batches, evals, evictions) and, when the trainer finishes, summary.json.
Killed and started again with the same --run-dir and --port, it continues the run from RUN_DIR/state.json
(and the batches the trainer may ask again, RUN_DIR/batches/).
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import threading
import time
from pathlib import Path

from elastic_mesh.broadcast.member import BroadcastMember
from elastic_mesh.control.token import JoinToken, read_token
from prime.core.cli import setup_logging
from prime.inference.hf_engine import HFEngine
from prime.rl.cli import load_config, read_token_argument
from prime.rl.environments import build_environment
from prime.rl.loop import evaluate
from prime.rl.orchestrator.config import OrchestratorConfig
from prime.rl.orchestrator.core import Orchestrator
from prime.rl.orchestrator.dashboard import PAGES, RunHistory, dashboard_answer
from prime.rl.orchestrator.dashboard import PATH as DASHBOARD
from prime.rl.orchestrator.run_store import RunStore
from prime.rl.orchestrator.versions import PolicyVersions
from prime.rl.policy_transport import POLICY_KIND, policy_broadcast_settings
from elastic_mesh.control.http import JsonServer, Refused, TokenCheck

log = logging.getLogger("prime.rl.orchestrator")


class Evaluations:
    """Held-out reward of chosen versions, greedy, on a thread of its own (never on a request's path)."""

    def __init__(self, orchestrator: Orchestrator, versions: PolicyVersions, env, record) -> None:
        self.orchestrator, self.versions, self.env, self.record = orchestrator, versions, env, record
        self.tasks = list(env.tasks("eval", orchestrator.config.seed))
        self.todo: queue.Queue[int] = queue.Queue()
        self.results: list[dict] = []
        self.last = -1
        threading.Thread(target=self._run, daemon=True, name="evaluations").start()

    def _run(self) -> None:
        while True:
            version = self.todo.get()
            self.evaluate(version)

    def evaluate(self, version: int) -> dict | None:
        try:
            model = self.versions.model(version)
        except KeyError:
            return None
        engine = HFEngine(model, pad_id=self.versions.tokenizer.pad_token_id)  # no proofs: nobody checks these
        reward = evaluate(engine, self.env, self.versions.tokenizer, self.tasks, self.orchestrator.config.max_tokens)
        result = {"event": "eval", "version": version, "time_s": self.orchestrator.elapsed(), "eval_reward": reward}
        self.results.append(result)
        self.last = max(self.last, version)
        self.record(result)
        log.info("version %d: held-out reward %.3f", version, reward)
        target = self.orchestrator.config.stop_at_reward
        if target is not None and reward >= target and not self.orchestrator.done:
            log.info("held-out reward %.3f reached the target %.3f: ending the run", reward, target)
            self.orchestrator.finish(version)
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prime.rl.orchestrator", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Config fields (OrchestratorConfig, docs/configuration.md) go in --config "
                                            "or as --set field=value.")
    parser.add_argument("--token", help="a run token (any role): to follow the policy broadcast")
    parser.add_argument("--token-file", type=Path, help="read the token from this file instead")
    parser.add_argument("--run-dir", type=Path, required=True, help="metrics, summary and policy copies go here")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default all)")
    parser.add_argument("--port", type=int, default=0, help="port (0: any free one; see RUN_DIR/address)")
    parser.add_argument("--advertise-host", default=None, help="host the trainer and workers reach this at "
                        "(default 127.0.0.1); the port is --port's (or the one picked)")
    parser.add_argument("--config", type=Path, help="a TOML file of OrchestratorConfig fields")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a config field")
    args = parser.parse_args(argv)
    setup_logging("[orchestrator] ")
    config = load_config(OrchestratorConfig, args.config, args.set)
    token = read_token_argument(args.token, args.token_file)
    facts = read_token(token)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    history, recorded_batches = RunHistory(), set()
    metrics_path = args.run_dir / "metrics.jsonl"
    earlier = metrics_path.read_text() if metrics_path.exists() else ""  # a restart: the dashboard shows the whole run
    for line in earlier.splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the stop
        history.add(event)
        if event.get("event") == "batch":
            recorded_batches.add(event["step"])
    metrics = metrics_path.open("a")
    if earlier and not earlier.endswith("\n"):
        metrics.write("\n")  # the stop cut the last line short: the next record starts a line of its own
    metrics_lock = threading.Lock()

    def record(event: dict) -> None:
        with metrics_lock:
            metrics.write(json.dumps(event) + "\n")
            metrics.flush()
        history.add(event)

    member = BroadcastMember(token, POLICY_KIND, args.run_dir / "broadcast",
                             policy_broadcast_settings(keep=config.async_level + 2, advertise_host=args.advertise_host))
    versions = PolicyVersions(member, args.run_dir / "policies", keep=config.async_level + 2,
                              verify_batch_size=config.verify_batch_size)
    env = build_environment(config.env, config.reward_terms)
    store = RunStore(args.run_dir)
    orchestrator = Orchestrator(config, env, versions, record, store)
    saved = store.load()
    if saved is not None:
        skipped = orchestrator.restore(saved)
        log.info("restarted (start %d of this run) at trainer step %d; %d prompts that were in flight at the stop "
                 "are skipped, none is used twice; %d workers stay evicted", orchestrator.start,
                 orchestrator.next_step, skipped, len(orchestrator.counters.evicted))
        orchestrator.record_unrecorded_batch(recorded_batches)
    evaluations = Evaluations(orchestrator, versions, env, record)
    wake = versions.on_new  # the orchestrator's own hook: wakes leases and batches waiting for a version


    def new_version(version: int) -> None:
        wake(version)
        # When each version could first be verified here (the wall clock: the trainer's records say when
        # it was published), for launch/bench/rl_async.py's account of a version's way to the workers.
        record({"event": "version", "version": version, "time_s": orchestrator.elapsed(), "loaded_at": time.time()})
        if version % config.eval_every == 0:
            evaluations.todo.put(version)
    versions.on_new = new_version
    check = TokenCheck(facts.coordinator, facts.run_id, tls_fp=facts.tls_fp)

    def trusted(token: JoinToken) -> None:
        if not token.publish:
            raise Refused(403, f"token {token.token_id} may not act as the trainer (no publish right)")

    def finish(token: JoinToken, body: dict) -> dict:
        trusted(token)
        version = int(body["version"])
        orchestrator.finish(version)
        # The trainer's server may be the only holder of its last version: it waits for this answer
        # before it stops serving, so answer once that version is here.
        waited = time.monotonic()
        while versions.newest < version and time.monotonic() - waited < 60:
            time.sleep(0.1)
        return {"status": "ok", "held": versions.newest}

    def batch(token: JoinToken, body: dict) -> dict:
        trusted(token)
        return orchestrator.batch(int(body["step"]), int(body.get("keep", 2)))

    def lease(token: JoinToken, body: dict) -> dict:
        if token.role != "worker":
            raise Refused(403, f"a {token.role} token cannot take rollout work; ask for a worker token")
        return orchestrator.lease(token.token_id, int(body.get("held", -1)))

    routes = {"/v1/rl/lease": lease,
              "/v1/rl/submit": lambda t, b: orchestrator.submit(t.token_id, b),
              "/v1/rl/give-back": lambda t, b: orchestrator.give_back(t.token_id, b),
              "/v1/rl/batch": batch,
              "/v1/rl/finish": finish,
              "/v1/rl/status": lambda t, b: {"status": "ok", "next_step": orchestrator.next_step,
                                             "newest": versions.newest, "leases": orchestrator.leases_by_worker(),
                                             **orchestrator.totals()},
              DASHBOARD: lambda t, b: dashboard_answer(orchestrator, history, b)}
    server = JsonServer(args.host, args.port, routes, check, read_only=frozenset({DASHBOARD}), pages=PAGES)
    server.tls = member.server.tls  # where the run speaks TLS: the certificate the coordinator gave this member
    advertise = f"{args.advertise_host or '127.0.0.1'}:{server.port}"
    server.start()
    staging = args.run_dir / "address.tmp"
    staging.write_text(advertise)
    staging.replace(args.run_dir / "address")
    log.info("orchestrator serving at %s (async level %d, %d prompts x %d samples per step); dashboard: "
             "%s://%s/#token=<an observer token of the run>", advertise, config.async_level, config.prompts_per_step,
             config.group_size, "https" if server.tls else "http", advertise)
    threading.Thread(target=versions.follow, daemon=True).start()
    threading.Thread(target=_expire_leases, args=(orchestrator,), daemon=True, name="lease-expiry").start()
    try:
        while not orchestrator.done:
            time.sleep(0.2)
        waited = time.monotonic()
        while versions.newest < orchestrator.final_version and time.monotonic() - waited < 60:
            time.sleep(0.1)  # the trainer's last version is still on its way to the follower
        final = versions.newest
        result = evaluations.evaluate(final) if evaluations.last != final else evaluations.results[-1]
        summary = {"versions": final, "time_s": orchestrator.elapsed(), "evals": evaluations.results,
                   "final_eval_reward": result["eval_reward"] if result else None, **orchestrator.totals(),
                   "evicted": orchestrator.counters.evicted, "config": config.model_dump()}
        (args.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        log.info("run finished: %d versions, held-out reward %s, %d rollouts accepted, %d rejected, %d stale",
                 final, f"{summary['final_eval_reward']:.3f}" if result else "n/a",
                 summary["rollouts_accepted"], summary["rollouts_rejected"], summary["rollouts_stale"])
        time.sleep(2.0)  # workers asking for leases hear "done" before the server goes
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        member.stop()
    return 0


def _expire_leases(orchestrator: Orchestrator) -> None:
    while True:
        time.sleep(0.5)
        orchestrator.expire()


if __name__ == "__main__":
    raise SystemExit(main())
