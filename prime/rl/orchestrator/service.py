"""The orchestrator process: the Orchestrator (core.py) behind its HTTP routes, with the policy versions
it follows, held-out evaluations, the run's records (metrics.jsonl, summary.json) and its dashboard.

It follows the policy broadcast with its token (any role), serves workers and the trainer, serves a
dashboard at / to any token of the run (rollouts/s, reward, staleness, each worker's verified and
rejected rollouts), and writes metrics.jsonl (batches, evals, evictions) and, when the trainer
finishes, summary.json. Killed and started again with the same run directory and port, it continues
the run from RUN_DIR/state.json (and the batches the trainer may ask again, RUN_DIR/batches/).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from elastic_mesh import BroadcastMember, JsonServer, Refused, Route, TokenCheck, read_token
from prime.rl.environments import build_environment
from prime.rl.orchestrator.config import OrchestratorConfig
from prime.rl.orchestrator.core import Orchestrator
from prime.rl.orchestrator.dashboard import PAGES, RunHistory, dashboard_answer
from prime.rl.orchestrator.dashboard import PATH as DASHBOARD
from prime.rl.orchestrator.evaluations import Evaluations
from prime.rl.orchestrator.run_store import RunStore
from prime.rl.orchestrator.versions import FollowedVersions
from prime.rl.token_flags import ORCHESTRATOR_SERVICE, worker_dtype
from prime.rl.transport.policy_files import POLICY_KIND, policy_broadcast_settings

log = logging.getLogger("prime.rl.orchestrator")


def submission_limit(config: OrchestratorConfig) -> int:
    """The most bytes a lease's submission may take: every rollout at max_tokens, each token as its id
    and logprob in JSON (~40 bytes, generously), its proof in base64 (258 bytes per 32 tokens), twice
    over; a body beyond it is refused before it is read."""
    rollouts = config.prompts_per_lease * config.group_size
    per_rollout = 512 + config.max_tokens * 40 + 4 * 258 * -(-config.max_tokens // 32) // 3 + 64
    return 2 * (4096 + rollouts * per_rollout)


class RunRecords:
    """metrics.jsonl, appended from several threads, and the history the dashboard shows (the whole
    run's, a restarted orchestrator's included)."""

    def __init__(self, path: Path) -> None:
        self.history, self.batches_recorded = RunHistory(), set()
        earlier = path.read_text() if path.exists() else ""
        for line in earlier.splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by the stop
            self.history.add(event)
            if event.get("event") == "batch":
                self.batches_recorded.add(event["step"])
        self._file = path.open("a")
        if earlier and not earlier.endswith("\n"):
            self._file.write("\n")  # the stop cut the last line short: the next record starts a line of its own
        self._lock = threading.Lock()

    def __call__(self, event: dict) -> None:
        with self._lock:
            self._file.write(json.dumps(event) + "\n")
            self._file.flush()
        self.history.add(event)

    def close(self) -> None:
        with self._lock:
            self._file.close()


class OrchestratorService:
    def __init__(self, config: OrchestratorConfig, orchestrator: Orchestrator, versions: FollowedVersions,
                 member: BroadcastMember, server: JsonServer, evaluations: Evaluations, records: RunRecords,
                 run_dir: Path, address: str) -> None:
        """address: host:port the trainer and workers reach this orchestrator at."""
        self.config, self.orchestrator, self.versions, self.member = config, orchestrator, versions, member
        self.server, self.evaluations, self.records, self.run_dir = server, evaluations, records, Path(run_dir)
        self.address = address

    @classmethod
    def build(cls, config: OrchestratorConfig, token: str, run_dir: Path, host: str = "0.0.0.0", port: int = 0,
              advertise_host: str | None = None) -> "OrchestratorService":
        """Restores the run's state (a restart), joins the broadcast and binds the server (not started)."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        records = RunRecords(run_dir / "metrics.jsonl")
        info = read_token(token)
        if info.tls_fp and info.service != ORCHESTRATOR_SERVICE:
            raise SystemExit(f"this run speaks TLS and token {info.token_id} names no service "
                             f"'{ORCHESTRATOR_SERVICE}': the trainer and workers would refuse this orchestrator's "
                             f"certificate. Make its token with `token create --role worker --service "
                             f"{ORCHESTRATOR_SERVICE}`")
        member = BroadcastMember(token, POLICY_KIND, run_dir / "broadcast",
                                 policy_broadcast_settings(keep=config.async_level + 2, advertise_host=advertise_host))
        versions = FollowedVersions(member, run_dir / "policies", keep=config.async_level + 2,
                                    verify_batch_size=config.verify_batch_size)
        env = build_environment(config.env, config.reward_terms)
        store = RunStore(run_dir)
        orchestrator = Orchestrator(config, env, versions, records, store)
        saved = store.load()
        if saved is not None:
            skipped = orchestrator.restore(saved)
            log.info("restarted (start %d of this run) at trainer step %d; %d prompts that were in flight at the "
                     "stop are skipped, none is used twice; %d workers stay evicted", orchestrator.start,
                     orchestrator.next_step, skipped, len(orchestrator.counters.evicted))
            orchestrator.record_unrecorded_batch(records.batches_recorded)
        evaluations = Evaluations(orchestrator, versions, env, records)
        wake = versions.on_new  # the orchestrator's own hook: wakes leases and batches waiting for a version

        def new_version(version: int) -> None:
            wake(version)
            # When each version could first be verified here (the wall clock: the trainer's records say when
            # it was published), for launch/bench/rl_async.py's account of a version's way to the workers.
            records({"event": "version", "version": version, "time_s": orchestrator.elapsed(), "loaded_at": time.time()})
            if version % config.eval_every == 0:
                evaluations.todo.put(version)
        versions.on_new = new_version
        check = TokenCheck.for_token(token)
        # tls: where the run speaks TLS, the certificate the coordinator gave this member
        server = JsonServer(host, port, cls._routes(config, orchestrator, versions, records), check, pages=PAGES,
                            limits=config.service, tls=member.server.tls)
        return cls(config, orchestrator, versions, member, server, evaluations, records, run_dir,
                   f"{advertise_host or '127.0.0.1'}:{server.port}")

    @staticmethod
    def _routes(config: OrchestratorConfig, orchestrator: Orchestrator, versions: FollowedVersions,
                records: RunRecords) -> dict[str, Route]:
        def trusted(token) -> None:
            if not token.publish:
                raise Refused(403, f"token {token.token_id} may not act as the trainer (no publish right)")

        def finish(token, body: dict) -> dict:
            trusted(token)
            version = int(body["version"])
            orchestrator.finish(version)
            # The trainer's server may be the only holder of its last version: it waits for this answer
            # before it stops serving, so answer once that version is here.
            waited = time.monotonic()
            while versions.newest < version and time.monotonic() - waited < 60:
                time.sleep(0.1)
            return {"status": "ok", "held": versions.newest}

        def batch(token, body: dict) -> dict:
            trusted(token)
            return orchestrator.batch(int(body["step"]), int(body.get("keep", 2)))

        def lease(token, body: dict) -> dict:
            if token.role != "worker":
                raise Refused(403, f"a {token.role} token cannot take rollout work; ask for a worker token")
            return orchestrator.lease(token.token_id, int(body.get("held", -1)), worker_dtype(token))

        small = 4 << 10  # a lease request, a give-back, a batch request: a few fields
        return {"/v1/rl/lease": Route(lease, small),
                "/v1/rl/submit": Route(lambda t, b: orchestrator.submit(t.token_id, b, worker_dtype(t)),
                                       submission_limit(config)),
                "/v1/rl/give-back": Route(lambda t, b: orchestrator.give_back(t.token_id, b), small),
                "/v1/rl/batch": Route(batch, small),
                "/v1/rl/finish": Route(finish, small),
                "/v1/rl/status": Route(lambda t, b: {"status": "ok", "next_step": orchestrator.next_step,
                                                     "newest": versions.newest,
                                                     "leases": orchestrator.leases_by_worker(),
                                                     **orchestrator.totals()}, small),
                DASHBOARD: Route(lambda t, b: dashboard_answer(orchestrator, records.history, b), small,
                                 read_only=True)}

    def run(self) -> int:
        """Serves until the trainer finishes (or stop_at_reward is reached); writes summary.json; 0."""
        advertise = self.address
        self.server.start()
        staging = self.run_dir / "address.tmp"
        staging.write_text(advertise)
        staging.replace(self.run_dir / "address")
        log.info("orchestrator serving at %s (async level %d, %d prompts x %d samples per step); dashboard: "
                 "%s://%s/#token=<an observer token of the run>", advertise, self.config.async_level,
                 self.config.prompts_per_step, self.config.group_size, "https" if self.server.tls else "http", advertise)
        threading.Thread(target=self.versions.follow, daemon=True, name="policy-versions").start()
        threading.Thread(target=self._expire_leases, daemon=True, name="lease-expiry").start()
        try:
            while not self.orchestrator.done:
                time.sleep(0.2)
            self._summarise()
            time.sleep(2.0)  # workers asking for leases hear "done" before the server goes
        except KeyboardInterrupt:
            pass
        return 0

    def _summarise(self) -> None:
        waited = time.monotonic()
        while self.versions.newest < self.orchestrator.final_version and time.monotonic() - waited < 60:
            time.sleep(0.1)  # the trainer's last version is still on its way to the follower
        final = self.versions.newest
        evaluations = self.evaluations
        result = evaluations.evaluate(final) if evaluations.last != final else evaluations.results[-1]
        summary = {"versions": final, "time_s": self.orchestrator.elapsed(), "evals": evaluations.results,
                   "final_eval_reward": result["eval_reward"] if result else None, **self.orchestrator.totals(),
                   "evicted": self.orchestrator.counters.evicted, "config": self.config.model_dump()}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        log.info("run finished: %d versions, held-out reward %s, %d rollouts accepted, %d rejected, %d stale",
                 final, f"{summary['final_eval_reward']:.3f}" if result else "n/a",
                 summary["rollouts_accepted"], summary["rollouts_rejected"], summary["rollouts_stale"])

    def _expire_leases(self) -> None:
        while True:
            time.sleep(0.5)
            self.orchestrator.expire()

    def close(self) -> None:
        self.server.stop()
        self.member.stop()
        self.records.close()
