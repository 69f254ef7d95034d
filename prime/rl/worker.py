"""An inference worker (untrusted): joins with a worker token, holds the policy version it is told to
use (fetched through the broadcast and re-served to other workers), generates rollouts for leased
prompts with the seeds the orchestrator chose, and returns them with their TOPLOC proofs.

    python -m prime.rl.worker --token-file worker.token --work-dir runs/rl/worker-a

The worker learns the orchestrator's address from the policy manifest (signed by the coordinator). It
exits 0 when the run ends, 3 when it is evicted, 2 when its token is refused.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from elastic_mesh.broadcast.member import (
    BroadcastError,
    BroadcastMember,
)
from elastic_mesh.control.client import CoordinatorClient, CoordinatorError
from prime.core.cli import setup_logging
from prime.inference.engine import Completion, GenerationRequest
from prime.inference.hf_engine import HFEngine
from prime.inference.sampling import SamplingParams
from prime.rl.cli import read_token_argument
from prime.rl.policy_transport import (
    POLICY_KIND,
    LoadedPolicy,
    fetch_policy,
    load_policy_directory,
    load_policy_version,
    meta_of,
    policy_broadcast_settings,
    prune_policies,
)
from prime.verify.proof import proof_observer

log = logging.getLogger("prime.rl.worker")

EXIT_DONE, EXIT_REFUSED, EXIT_EVICTED = 0, 2, 3
# What a test may put between generation and submission (prime/testing/rogue_worker.py): never set in
# production. (requests, completions, engine) -> completions.
Tamper = Callable[[list[GenerationRequest], list[Completion], HFEngine], list[Completion]]


class HeldPolicy:
    """The versions this worker holds: the newest one it loaded generates; a background follower loads
    each new one as it is announced, so a worker is rarely told to fetch."""

    def __init__(self, member: BroadcastMember, root: Path, dtype: torch.dtype) -> None:
        self.member, self.root, self.dtype = member, root, dtype
        self.version = -1
        self.newest: LoadedPolicy | None = None  # the newest version's model, a template for the next one
        self.engines: dict[int, HFEngine] = {}  # the newest two: a lease granted just before a new version
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.coming: set[int] = set()  # the versions the follower is downloading now
        # version -> wall clock when it was announced here, fetched (verified), could generate (for the benchmark)
        self.announced_at: dict[int, float] = {}
        self.fetched_at: dict[int, float] = {}
        self.loaded_at: dict[int, float] = {}

    def load(self, directory: Path, version: int, fetch_s: float | None = None) -> None:
        """Loads a version fetched on demand (written to `directory`)."""
        with self.lock:
            if version in self.engines:
                return
        started = time.monotonic()
        try:
            loaded = load_policy_directory(directory, self.dtype)
        except OSError as e:  # pruned meanwhile: two newer versions were loaded
            raise BroadcastError(f"version {version} was retired while it was loaded ({e})") from None
        self._adopt(loaded, version, started, fetch_s)

    def _adopt(self, loaded: LoadedPolicy, version: int, started: float, fetch_s: float | None) -> None:
        engine = HFEngine(loaded.model, pad_id=int(loaded.model.config.pad_token_id or 0),
                          observer=proof_observer(loaded.thresholds.proof))
        with self.changed:
            self.engines[version] = engine
            if version >= self.version:
                self.version, self.newest = version, loaded
            for old in sorted(self.engines)[:-2]:
                del self.engines[old]
            self.loaded_at[version] = time.time()
            self.changed.notify_all()
            oldest = min(self.engines)
        prune_policies(self.root, oldest)
        log.info("policy version %d loaded in %.2f s%s", version, time.monotonic() - started,
                 f" (fetched in {fetch_s:.2f} s)" if fetch_s is not None else "")

    def fetch(self, version: int) -> None:
        started = time.monotonic()
        if self._await_follower(version):
            return
        try:
            directory = fetch_policy(self.member, self.member.manifest(version), self.root)
        except FileNotFoundError:  # the follower loaded two newer ones meanwhile, and retired this one
            raise BroadcastError(f"version {version} was retired while it was written (newer ones arrived)") from None
        self.load(directory, version, time.monotonic() - started)

    def _await_follower(self, version: int, timeout_s: float = 30.0, grace_s: float = 0.3) -> bool:
        """Whether the follower, downloading `version` (or a newer one), loaded it (or newer) within
        timeout_s: a second download of the same bytes would halve the speed of both. The orchestrator
        hears of a version about when this worker does, so a follower not yet on it gets grace_s to start."""
        now = time.monotonic()
        give_up, grace = now + timeout_s, now + grace_s
        with self.changed:
            while self.version < version and (max(self.coming, default=-1) >= version or time.monotonic() < grace) \
                    and time.monotonic() < give_up:
                self.changed.wait(0.05 if max(self.coming, default=-1) < version else 0.5)
            return self.version >= version

    def _announced(self, manifest: dict) -> None:
        with self.changed:
            version = int(manifest["version"])
            self.coming.add(version)
            self.announced_at[version] = time.time()
            self.changed.notify_all()

    def _fetched(self, target, report) -> None:
        with self.lock:
            self.fetched_at[target.version] = time.time()
        started = time.monotonic()
        try:
            with self.lock:
                known, like = target.version in self.engines, self.newest
            if not known:  # straight from the verified chunks into a copy of the newest model
                self._adopt(load_policy_version(target, self.root, self.dtype, like), target.version, started,
                            report.seconds)
        except (BroadcastError, OSError) as e:  # retired meanwhile (newer ones came): on to the next version
            log.warning("version %d not loaded: %s", target.version, e)
        finally:
            self._settled(target.version)

    def _failed(self, manifest: dict, error: BroadcastError) -> None:
        self._settled(int(manifest["version"]))

    def _settled(self, version: int) -> None:
        with self.changed:
            self.coming.discard(version)
            self.changed.notify_all()

    def follow(self) -> None:
        self.member.follow(on_version=self._fetched, on_announced=self._announced, on_failed=self._failed)


def main(argv: list[str] | None = None, tamper: Tamper | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prime.rl.worker", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--token", help="a worker token of the run")
    parser.add_argument("--token-file", type=Path, help="read the token from this file instead")
    parser.add_argument("--work-dir", type=Path, required=True, help="policy versions are kept (and served) from here")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="compute dtype (claimed in every rollout; the verifier holds it to that dtype's limits)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for generation (default 1)")
    parser.add_argument("--port", type=int, default=0, help="port of this worker's chunk server (0: any)")
    parser.add_argument("--advertise-host", default=None, help="host other workers reach this one at")
    parser.add_argument("--wait-s", type=float, default=600, help="how long to wait for the first policy version")
    parser.add_argument("--in-flight", type=int, default=2, choices=range(1, 9), metavar="N",
                        help="submissions awaiting the orchestrator's verification at once (1-8, default 2): "
                        "generating goes on meanwhile")
    args = parser.parse_args(argv)
    setup_logging("[worker] ")
    torch.set_num_threads(args.threads)
    token = read_token_argument(args.token, args.token_file)
    settings = policy_broadcast_settings(keep=2, advertise_host=args.advertise_host, port=args.port)
    try:
        member = BroadcastMember(token, POLICY_KIND, args.work_dir / "broadcast", settings)
    except BroadcastError as e:
        log.error("cannot join: %s", e)
        return EXIT_REFUSED
    try:
        newest = member.wait_newer(-1, timeout_s=args.wait_s)
    except BroadcastError as e:
        log.error("cannot read the policy broadcast: %s", e)
        return EXIT_REFUSED
    if newest is None:
        log.error("no policy version was published within %.0f s; is the trainer running?", args.wait_s)
        return EXIT_REFUSED
    address = meta_of(newest).get("orchestrator")
    if not address:
        log.error("the policy manifest names no orchestrator; is the trainer a prime.rl trainer?")
        return EXIT_REFUSED
    held = HeldPolicy(member, args.work_dir / "policies", getattr(torch, args.dtype))
    held.fetch(int(newest["version"]))
    threading.Thread(target=held.follow, daemon=True, name="policy-follower").start()
    orchestrator = CoordinatorClient(address, request_timeout_s=60, retry_s=60, bearer=token,
                                     tls=member.client.tls_context())
    log.info("worker ready at version %d; orchestrator %s", held.version, address)
    stats = WorkerClock(args.work_dir / "worker.json", held)
    submitter = Submitter(orchestrator, stats, args.in_flight)
    leases = LeasesAhead(orchestrator, held, stats)
    try:
        while True:
            ended = submitter.ended()
            if ended is not None:
                return ended
            try:
                answer = leases.next()
            except CoordinatorError as e:
                return _ended(e, "lease")
            status = answer.get("status")
            if status == "done":
                ended = submitter.wait()
                if ended is not None and ended != EXIT_DONE:
                    return ended
                stats.write()
                log.info("the run is over: %s", stats.summary())
                return EXIT_DONE
            if status == "fetch":
                if held.version >= int(answer["version"]):  # the orchestrator has not seen what the follower loaded
                    continue  # the next lease names the newer version; the orchestrator waits for it too
                log.info("told to fetch version %d (holding %d)", answer["version"], held.version)
                fetching = time.monotonic()
                try:
                    held.fetch(int(answer["version"]))
                except BroadcastError as e:  # no source left for it: a newer one will come
                    log.warning("version %d not fetched: %s", answer["version"], e)
                stats.add("fetching_s", time.monotonic() - fetching)
                continue
            if status != "ok":
                continue
            with held.lock:
                engine = held.engines.get(int(answer["version"]))
            if engine is None:  # a lease on the version the follower is loading (the orchestrator heard of it)
                fetching = time.monotonic()
                try:
                    held.fetch(int(answer["version"]))
                    with held.lock:
                        engine = held.engines.get(int(answer["version"]))
                    if engine is None:  # loaded, then dropped: the follower loaded two newer ones meanwhile
                        raise BroadcastError("two newer versions were loaded meanwhile")
                except BroadcastError as e:
                    log.warning("leased version %d not fetched: %s; lease %s given back", answer["version"], e,
                                answer["lease"])
                    ended = _give_back(orchestrator, answer["lease"], f"version {answer['version']} not fetched")
                    if ended is not None:
                        return ended
                    continue
                finally:
                    stats.add("fetching_s", time.monotonic() - fetching)
            began = time.monotonic()
            sampling = SamplingParams.model_validate(answer["sampling"])
            requests = [GenerationRequest(list(r["prompt"]), int(r["seed"]), sampling) for r in answer["requests"]]
            completions = engine.generate(requests)
            if tamper is not None:
                completions = tamper(requests, completions, engine)
            body = {"lease": answer["lease"], "completions": [_wire(c, args.dtype) for c in completions]}
            stats.add("busy_s", time.monotonic() - began)
            ended = submitter.submit(answer["lease"], body, len(completions))
            if ended is not None:
                return ended
    finally:
        leases.close()
        submitter.close()
        member.stop()


class LeasesAhead:
    """Asks the orchestrator for the next lease while the worker generates and submits this one. A lease
    request is a round trip to the orchestrator, and in line it took a worker longer than generating a
    lease's rollouts (0.11 s against 0.04 s a lease, 10 ms links): one request is kept on its way after
    each lease granted, as long as a lease takes this worker under a quarter of the lease's time (a lease
    asked ahead starts its clock while the worker is still busy with the last one: a slow worker would see
    its leases expire). What the worker waited for a lease is counted as lease_s (or waiting_s when the
    answer was not a lease)."""

    def __init__(self, orchestrator: CoordinatorClient, held: HeldPolicy, stats: "WorkerClock") -> None:
        self.orchestrator, self.held, self.stats = orchestrator, held, stats
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lease")
        self._ahead: Future | None = None
        self._last_granted: float | None = None  # when the last lease was handed to the worker

    def _ask(self) -> tuple[dict | None, CoordinatorError | None]:
        try:
            return self.orchestrator.post("/v1/rl/lease", {"held": self.held.version}), None
        except CoordinatorError as e:
            return None, e

    def next(self) -> dict:
        """The orchestrator's answer to a lease request (raises CoordinatorError as its post does). After a
        lease granted, the next request goes out at once; after any other answer the next is asked in line
        (a "fetch" or "wait" must be acted on first, "done" ends the worker)."""
        waited = time.monotonic()
        pending, self._ahead = self._ahead, None
        answer, error = (pending or self._pool.submit(self._ask)).result()
        if error is not None:
            raise error
        granted = answer.get("status") == "ok"
        now = time.monotonic()
        self.stats.add("lease_s" if granted else "waiting_s", now - waited)
        if granted:
            # The last lease's whole turn (generating, waiting to submit, asking for this one).
            took = now - self._last_granted if self._last_granted is not None else None
            self._last_granted = now
            if took is not None and took < float(answer.get("lease_s", 0)) / 4:
                self._ahead = self._pool.submit(self._ask)
        return answer

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Submitter:
    """Sends each lease's rollouts in the background, up to `in_flight` submissions at a time, so the
    worker leases and generates the next leases while the orchestrator verifies the last ones. A
    submission is answered only once verified, and that is most of its time: with one in flight a worker
    waited 46% of its time for the last answer (async 2, 10 ms links), and each lease asked ahead aged
    meanwhile. The leases stay the worker's until their rollouts arrive, so the orchestrator hands out
    no more work for them; verification runs in parallel there (one server thread per request)."""

    def __init__(self, orchestrator: CoordinatorClient, stats: "WorkerClock", in_flight: int = 2) -> None:
        if in_flight < 1:
            raise ValueError(f"in_flight must be at least 1, not {in_flight}")
        self.orchestrator, self.stats, self.in_flight = orchestrator, stats, in_flight
        self._pool = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="submit")
        self._pending: deque[Future] = deque()  # oldest first

    def submit(self, lease: str, body: dict, rollouts: int) -> int | None:
        """Sends this submission once fewer than `in_flight` are unanswered (waiting for the oldest). An
        exit code when an answer ended this worker (evicted, refused, the orchestrator gone)."""
        ended = self.ended()
        while ended is None and len(self._pending) >= self.in_flight:
            ended = self._wait_oldest()
        if ended is None:
            self._pending.append(self._pool.submit(self._send, lease, body, rollouts))
        return ended

    def ended(self) -> int | None:
        """The exit code of a submission that has been answered and ended this worker, without waiting."""
        while self._pending and self._pending[0].done():
            ended = self._wait_oldest()
            if ended is not None:
                return ended
        return None

    def wait(self) -> int | None:
        """Waits for every submission's answer; the exit code of the first that ended this worker."""
        ended = None
        while self._pending:
            answer = self._wait_oldest()
            ended = answer if ended is None else ended
        return ended

    def _wait_oldest(self) -> int | None:
        waited = time.monotonic()
        ended = self._pending.popleft().result()
        self.stats.add("submit_s", time.monotonic() - waited)
        return ended

    def _send(self, lease: str, body: dict, rollouts: int) -> int | None:
        try:
            result = self.orchestrator.post("/v1/rl/submit", body)
        except CoordinatorError as e:
            return _ended(e, "submit")
        if result.get("status") == "accepted":
            self.stats.accepted(rollouts)
        else:
            log.info("lease %s: %s", lease, result.get("status"))
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class WorkerClock:
    """Where this worker's time goes, written to worker.json after every accepted submission (read by
    launch/bench/rl_async.py): generating (busy_s), asking for a lease that came (lease_s) or did not
    (waiting_s), waiting for the answer to the previous submission before sending the next (submit_s:
    the orchestrator verifies before it answers; sent in the background meanwhile), fetching a version
    it was told to (fetching_s), and when each version was announced, fetched and usable here
    (announced_at, fetched_at, loaded_at: wall clock)."""

    def __init__(self, path: Path, held: HeldPolicy) -> None:
        self.path, self.held = path, held
        self.rollouts, self.started = 0, time.monotonic()
        self.seconds = {"busy_s": 0.0, "lease_s": 0.0, "waiting_s": 0.0, "submit_s": 0.0, "fetching_s": 0.0}
        self._lock = threading.Lock()  # submissions are answered on several threads

    def add(self, what: str, seconds: float) -> None:
        with self._lock:
            self.seconds[what] += seconds

    def accepted(self, rollouts: int) -> None:
        with self._lock:
            self.rollouts += rollouts
        self.write()

    def write(self) -> None:
        with self.held.lock:
            times = {name: dict(sorted(getattr(self.held, name).items())[-1000:])
                     for name in ("announced_at", "fetched_at", "loaded_at")}
        with self._lock:
            staging = self.path.with_suffix(".json.tmp")
            staging.write_text(json.dumps({"rollouts": self.rollouts,
                                           "seconds": round(time.monotonic() - self.started, 3),
                                           **{k: round(v, 3) for k, v in self.seconds.items()}, **times}))
            staging.replace(self.path)

    def summary(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return f"{self.rollouts} rollouts in {elapsed:.0f} s (" + ", ".join(
            f"{k.removesuffix('_s')} {100 * v / elapsed:.0f}%" for k, v in self.seconds.items()) + ")"


def _wire(completion: Completion, dtype: str) -> dict:
    return {"tokens": completion.tokens, "logprobs": completion.logprobs, "finish_reason": completion.finish_reason,
            "proof": base64.b64encode(completion.proof).decode(), "compute_dtype": dtype}


def _give_back(orchestrator: CoordinatorClient, lease: str, reason: str) -> int | None:
    """Hands a lease back unworked; an exit code when the answer ends this worker."""
    try:
        orchestrator.post("/v1/rl/give-back", {"lease": lease, "reason": reason})
    except CoordinatorError as e:
        return _ended(e, "give-back")
    return None


def _ended(error: CoordinatorError, what: str) -> int:
    if error.status == 403 and "evicted" in str(error):
        log.error("evicted by the orchestrator: %s", error)
        return EXIT_EVICTED
    if error.status in (401, 403):
        log.error("the orchestrator refused this worker's %s: %s", what, error)
        return EXIT_REFUSED
    log.error("the orchestrator is gone (%s): %s; assuming the run is over", what, error)
    return EXIT_DONE


if __name__ == "__main__":
    raise SystemExit(main())
