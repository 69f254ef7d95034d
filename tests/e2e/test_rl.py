"""Asynchronous GRPO with real processes: coordinator, orchestrator, trainer and workers, each started
through its command line, talking over sockets; the policy travels by broadcast and every rollout is
verified. Faults: a worker SIGKILLed while it holds a lease, a cheating worker, a worker joining
mid-run, the orchestrator and the trainer (2 ranks, FSDP2) each SIGKILLed and restarted."""

from __future__ import annotations

import json
import re

import pytest

from elastic_mesh.control.client import CoordinatorClient, CoordinatorError
from elastic_mesh.control.token import read_token
from launch.cluster import wait_for
from launch.rl_cluster import RLCluster, new_policy
from tests.e2e.test_dashboard import canvas_points, render

MAX_STEPS = 24


def test_workers_come_and_go_rogues_are_evicted_and_the_trainer_resumes(tmp_path, chromium):
    policy = new_policy(tmp_path / "policy")  # thresholds measured as the demo measures them
    cluster = RLCluster(tmp_path / "run", policy, orchestrator_sets=[
        "prompts_per_step=8", "prompts_per_lease=2", "lease_s=4", "eval_every=8", "poll_s=2", "async_level=1"],
        trainer_sets=[f"max_steps={MAX_STEPS}"], trainer_ranks=2)  # FSDP2 over 2 local ranks (torchrun)
    with cluster:
        cluster.start([])
        # worker-a is honest but holds each lease 2 s, so it is surely mid-lease when it is killed
        cluster.start_worker("worker-a", module="prime.testing.rogue_worker", extra=["--attack", "stall"])
        cluster.start_worker("rogue", module="prime.testing.rogue_worker", extra=["--attack", "answer-swap"])
        status = CoordinatorClient(cluster.orchestrator_address, retry_s=30,
                                   bearer=cluster.token("trainer", publish=True).read_text())
        assert cluster.wait("rogue", 120) == 3, cluster.log("rogue")  # exit 3: evicted
        # worker-a SIGKILLed while it holds a lease: the lease's prompts must come back, none twice
        worker_a = read_token(cluster.tokens["worker-a"]).token_id
        wait_for(lambda: status.post("/v1/rl/status", {})["next_step"] >= 3, 120, "three batches")
        wait_for(lambda: status.post("/v1/rl/status", {})["leases"].get(worker_a), 120, "worker-a holding a lease")
        cluster.kill("worker-a")
        killed_at = status.post("/v1/rl/status", {})["next_step"]
        cluster.start_worker("worker-b")  # joins mid-run: must get the current version by broadcast
        wait_for(lambda: status.post("/v1/rl/status", {})["next_step"] >= killed_at + 4, 180, "progress after the kill")
        # The dashboard, as an operator opens it with an observer token: each worker's verdicts, the charts.
        observer = cluster.token("observer", role="observer").read_text()
        board = CoordinatorClient(cluster.orchestrator_address, retry_s=30, bearer=observer).post("/v1/rl/dashboard", {})
        workers = {w["worker"]: w for w in board["workers"]}
        rogue = read_token(cluster.tokens["rogue"]).token_id
        assert workers[rogue]["evicted"] and workers[rogue]["rejected"] >= 16, workers
        assert workers[worker_a]["verified"] > 0 and workers[worker_a]["expired"] >= 1, workers
        assert [e["step"] for e in board["events"] if e["event"] == "batch"][:3] == [0, 1, 2], board["events"][:5]
        with pytest.raises(CoordinatorError, match="observer"):  # it reads; it cannot take work
            CoordinatorClient(cluster.orchestrator_address, retry_s=5, bearer=observer).post(
                "/v1/rl/lease", {"held": 0}, retry=False)
        dom = render(chromium, f"http://{cluster.orchestrator_address}/#token={observer}")
        assert rogue in dom and "evicted" in dom, dom[:3000]
        assert canvas_points(dom, "reward-chart") > 0 and canvas_points(dom, "staleness-chart") > 0
        assert canvas_points(dom, "path-chart") > 0
        # The orchestrator SIGKILLed and started again on its port and run directory: it continues the run.
        cluster.kill("orchestrator")
        stopped_at = json.loads((cluster.run_dir / "orchestrator" / "state.json").read_text())["next_step"]
        cluster.start_orchestrator()
        wait_for(lambda: status.post("/v1/rl/status", {})["next_step"] >= stopped_at + 2, 180, "progress after the restart")
        assert "restarted (start 1 of this run)" in cluster.log("orchestrator")
        cluster.kill("trainer")
        cluster.start_trainer()  # the same command: resumes from its checkpoint
        assert cluster.wait("orchestrator", 240) == 0, cluster.log("orchestrator")
        assert cluster.wait("worker-b", 60) == 0
    summary = cluster.summary()
    batches = cluster.events("batch")
    assert summary["versions"] == MAX_STEPS and [b["step"] for b in batches] == list(range(MAX_STEPS))
    numbers = [n for b in batches for n in b["prompt_numbers"]]
    assert len(numbers) == len(set(numbers)) == 8 * MAX_STEPS  # no prompt in two batches (or twice in one)
    assert all(rogue not in b["workers"] for b in batches)
    assert rogue in summary["evicted"] and "sampling" in summary["evicted"][rogue]
    assert summary["rollouts_rejected"] >= 16 and summary["workers_evicted"] == 1
    assert summary["leases_expired"] >= 1  # worker-a's
    # From its last checkpoint (every 5 steps by default), training again on the batches the orchestrator kept.
    resumed = re.search(r"resumed from \S+: step (\d+)", cluster.log("trainer"))
    assert resumed and int(resumed.group(1)) % 5 == 0, cluster.log("trainer")[-2000:]
    loaded = [line for line in cluster.log("worker-b").splitlines() if "policy version" in line and "loaded" in line]
    assert loaded and int(loaded[0].split("policy version ")[1].split()[0]) >= killed_at - 1 >= 2, loaded[:2]
    trainer = [json.loads(line) for line in (cluster.run_dir / "trainer" / "metrics.jsonl").read_text().splitlines()]
    # Each step once: the steps trained again after the restart replaced their first records.
    assert [r["step"] for r in trainer] == list(range(1, MAX_STEPS + 1)) and all(r["staleness_max"] <= 1 for r in trainer)
    # Versions loaded into memory leave the disk: the worker keeps its newest two, the orchestrator async + 2.
    kept = {name: sorted(p.name for p in (cluster.run_dir / name / "policies").iterdir())
            for name in ("worker-b", "orchestrator")}
    assert len(kept["worker-b"]) <= 2 and len(kept["orchestrator"]) <= 3, kept
    # The batches a restarted trainer may ask again: checkpoint_every + 1, each in a file of its own.
    batch_files = sorted(p.name for p in (cluster.run_dir / "orchestrator" / "batches").iterdir())
    assert batch_files == [f"{s:08d}.json" for s in range(MAX_STEPS - 6, MAX_STEPS)], batch_files
