"""An inference worker (untrusted): joins with a worker token, holds the policy version it is told to
use (fetched through the broadcast and re-served to other workers), generates rollouts for leased
prompts with the seeds the orchestrator chose, and returns them with their TOPLOC proofs.

The worker learns the orchestrator's address from the policy manifest (signed by the coordinator). It
exits 0 when the run ends, 3 when it is evicted, 2 when its token is refused.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from elastic_mesh import BroadcastError, BroadcastMember, CoordinatorClient, CoordinatorError, read_token
from prime.inference.engine import Completion, GenerationRequest
from prime.inference.hf_engine import HFEngine
from prime.inference.sampling import SamplingParams
from prime.rl.token_flags import ORCHESTRATOR_SERVICE, worker_dtype
from prime.rl.transport.policy_files import LoadedPolicy, POLICY_KIND, meta_of, policy_broadcast_settings
from prime.rl.transport.weights import PolicyFollower
from prime.rl.worker.clock import WorkerClock
from prime.rl.worker.config import WorkerConfig
from prime.rl.worker.session import (
    EXIT_DONE,
    EXIT_REFUSED,
    LeasesAhead,
    Submitter,
    exit_code,
    give_back,
    to_wire,
)
from prime.verify.proof import proof_observer

log = logging.getLogger("prime.rl.worker")

# What a test may put between generation and submission (prime/testing/rogue_worker.py): never set in
# production. (requests, completions, engine) -> completions.
Tamper = Callable[[list[GenerationRequest], list[Completion], HFEngine], list[Completion]]


def generation_engine(policy: LoadedPolicy) -> HFEngine:
    """What a worker builds of each version it holds: an engine proving its rollouts in the shape the
    version's thresholds were calibrated for."""
    return HFEngine(policy.model, pad_id=int(policy.model.config.pad_token_id or 0),
                    observer=proof_observer(policy.thresholds.proof))


class InferenceWorker:
    """One worker's loop: ask for a lease, generate its rollouts with the version it names, submit them
    (in the background, while the next lease is worked), until the run ends or the worker is evicted."""

    def __init__(self, config: WorkerConfig, member: BroadcastMember, held: PolicyFollower[HFEngine],
                 orchestrator: CoordinatorClient, work_dir: Path, tamper: Tamper | None = None) -> None:
        self.config, self.member, self.held, self.orchestrator = config, member, held, orchestrator
        self.tamper = tamper
        self.stats = WorkerClock(Path(work_dir) / "worker.json", held)
        self.submitter = Submitter(orchestrator, self.stats, config.in_flight)
        self.leases = LeasesAhead(orchestrator, held, self.stats)

    @classmethod
    def join(cls, config: WorkerConfig, token: str, work_dir: Path, port: int = 0, advertise_host: str | None = None,
             tamper: Tamper | None = None) -> "InferenceWorker | int":
        """Joins the broadcast, waits for the first policy version and holds it; the worker, or the exit
        code that says why it cannot take part."""
        torch.set_num_threads(config.threads)
        admitted = worker_dtype(read_token(token))
        if admitted != config.dtype:  # the orchestrator holds its rollouts to its token's dtype, whatever they claim
            log.error("this worker computes in %s, but its token admits it as a %s worker: run it with --dtype %s, "
                      "or ask the operator for a token made with --attributes dtype=%s", config.dtype, admitted,
                      admitted, config.dtype)
            return EXIT_REFUSED
        settings = policy_broadcast_settings(keep=2, advertise_host=advertise_host, port=port)
        try:
            member = BroadcastMember(token, POLICY_KIND, Path(work_dir) / "broadcast", settings)
        except BroadcastError as e:
            log.error("cannot join: %s", e)
            return EXIT_REFUSED
        try:
            newest = member.wait_newer(-1, timeout_s=config.wait_s)
        except BroadcastError as e:
            log.error("cannot read the policy broadcast: %s", e)
            newest = None
        address = meta_of(newest).get("orchestrator") if newest is not None else None
        if not address:
            member.stop()
            if newest is not None:
                log.error("the policy manifest names no orchestrator; is the trainer a prime.rl trainer?")
            else:
                log.error("no policy version was published within %.0f s; is the trainer running?", config.wait_s)
            return EXIT_REFUSED
        held = PolicyFollower(member, Path(work_dir) / "policies", getattr(torch, config.dtype), keep=2,
                              build=generation_engine)
        try:
            held.get(int(newest["version"]), wait_s=0)
        except KeyError:
            member.stop()
            log.error("the first policy version could not be fetched")
            return EXIT_REFUSED
        threading.Thread(target=held.follow, daemon=True, name="policy-follower").start()
        orchestrator = CoordinatorClient(address, request_timeout_s=60, retry_s=60, bearer=token,
                                         tls=member.client.tls_context(), service=ORCHESTRATOR_SERVICE)
        log.info("worker ready at version %d; orchestrator %s", held.newest, address)
        return cls(config, member, held, orchestrator, work_dir, tamper)

    def run(self) -> int:
        """Works leases until the run ends; the exit code (0 done, 2 refused, 3 evicted)."""
        while True:
            ended = self.submitter.ended()
            if ended is not None:
                return ended
            try:
                answer = self.leases.next()
            except CoordinatorError as e:
                return exit_code(e, "lease")
            status = answer.get("status")
            if status == "done":
                ended = self.submitter.wait()
                if ended is not None and ended != EXIT_DONE:
                    return ended
                self.stats.write()
                log.info("the run is over: %s", self.stats.summary())
                return EXIT_DONE
            if status == "fetch":
                self._fetch(int(answer["version"]))
            elif status == "ok":
                ended = self._work(answer)
                if ended is not None:
                    return ended

    def _fetch(self, version: int) -> None:
        """Told to hold a newer version before more work."""
        if self.held.newest >= version:  # the orchestrator answered before it heard what the follower loaded
            time.sleep(0.2)  # the next lease names the newer version; never a loop of instant answers
            return
        log.info("told to fetch version %d (holding %d)", version, self.held.newest)
        fetching = time.monotonic()
        try:
            self.held.get(version, wait_s=self.config.fetch_wait_s)
        except KeyError:  # no source left for it: a newer one will come
            log.warning("version %d not fetched: no source left for it, or retired meanwhile", version)
        self.stats.add("fetching_s", time.monotonic() - fetching)

    def _work(self, lease: dict) -> int | None:
        """Generates a lease's rollouts and hands them to the submitter; an exit code when that ended
        this worker."""
        version = int(lease["version"])
        fetching = time.monotonic()
        try:  # usually held already; else the follower is loading it (the orchestrator heard of it) or it skipped it
            engine = self.held.get(version, wait_s=self.config.fetch_wait_s).built
        except KeyError:
            log.warning("leased version %d not fetched (no source left, or retired meanwhile); lease %s given back",
                        version, lease["lease"])
            return give_back(self.orchestrator, lease["lease"], f"version {version} not fetched")
        finally:
            self.stats.add("fetching_s", time.monotonic() - fetching)
        began = time.monotonic()
        sampling = SamplingParams.model_validate(lease["sampling"])
        requests = [GenerationRequest(list(r["prompt"]), int(r["seed"]), sampling) for r in lease["requests"]]
        completions = engine.generate(requests)
        if self.tamper is not None:
            completions = self.tamper(requests, completions, engine)
        body = {"lease": lease["lease"], "completions": [to_wire(c, self.config.dtype) for c in completions]}
        self.stats.add("busy_s", time.monotonic() - began)
        return self.submitter.submit(lease["lease"], body, len(completions))

    def close(self) -> None:
        self.leases.close()
        self.submitter.close()
        self.member.stop()
