"""The coordinator's dashboard, rendered by a real headless Chromium against a running 2-node cluster,
and `prime.tools.report` over the files that run left behind.

Chromium is Debian's `chromium` package; the fixture installs it when it is missing (root + apt). A
machine that cannot have it fails this test with the command to run: it never passes without a browser.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from launch.cluster import LocalCluster, wait_for
from launch.rl_cluster import RLCluster, calibrate

OVERRIDES = ["--train.max_steps", "400", "--train.eval_every", "10", "--chaos.step_delay_s", "0.05", "--checkpoint.keep", "100"]


def render(chromium: str, url: str, screenshot=None) -> str:
    """The page's DOM after its scripts ran (and polled the coordinator) for a few seconds."""
    args = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1400,1100",
            "--virtual-time-budget=8000"]
    args += [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
    result = subprocess.run([*args, url], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout



def canvas_points(dom: str, chart: str) -> int:
    match = re.search(rf'<canvas id="{chart}"[^>]*data-points="(\d+)"', dom)
    assert match, f"chart {chart} was never drawn"
    return int(match.group(1))


@pytest.mark.timeout(480)
def test_dashboard_shows_a_live_two_node_run_whose_export_post_trains_with_rl(tmp_path, chromium):
    with LocalCluster(tmp_path / "run", "configs/debug.toml", OVERRIDES) as cluster:
        cluster.start_coordinator(start_nodes=2)
        for name in ("node0", "node1"):
            cluster.start_node(name)

        def reporting():
            status = cluster.status()
            return status["committed_round"] >= 4 and all(n.get("loss") for n in status["nodes"]) and status
        status = wait_for(reporting, 180, "both nodes to report losses and 4 outer steps to commit")
        base = f"http://127.0.0.1:{cluster.port}/"

        dom = render(chromium, f"{base}#token={cluster.token}")
        rows = re.findall(r'<tr data-node="([^"]+)">(.*?)</tr>', dom, re.S)
        assert sorted(name for name, _ in rows) == ["node0", "node1"], dom[:3000]
        for _, row in rows:
            assert "active" in row and "127.0.0.1" in row
        assert canvas_points(dom, "loss-chart") >= 10
        assert canvas_points(dom, "allreduce-chart") >= 4
        assert canvas_points(dom, "membership-chart") >= 8  # 2 members × ≥ 4 outer steps
        assert status["run_id"] in dom

        # Live: a later render sees more of the run without anything being reloaded by hand.
        wait_for(lambda: cluster.status()["committed_round"] >= status["committed_round"] + 3, 120, "3 more outer steps")
        later = render(chromium, f"{base}#token={cluster.token}")
        assert canvas_points(later, "allreduce-chart") > canvas_points(dom, "allreduce-chart")

        shot = tmp_path / "dashboard.png"
        render(chromium, f"{base}#token={cluster.token}", screenshot=shot)
        assert shot.stat().st_size > 20_000
        print(f"dashboard screenshot: {shot}")

        # Without a token the page loads but shows why it has no data, and the data stays private.
        denied = render(chromium, base)
        assert "needs a join token" in denied and 'data-node="' not in denied
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{base}v1/history", timeout=10)
        assert refused.value.code == 401
        cluster.stop()

    # The report over what the run wrote (nodes' metrics.jsonl + the coordinator's SQLite, read-only).
    report = subprocess.run([sys.executable, "-m", "prime.tools.report", str(tmp_path / "run")], capture_output=True,
                            text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    out = tmp_path / "run" / "report"
    for png in ("loss.png", "timeline.png", "membership.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, png
    summary = (out / "summary.md").read_text()
    assert "| node0 |" in summary and "| node1 |" in summary and "attempts aborted" in summary
    committed = int(re.search(r"Coordinator: (\d+) outer steps committed", summary).group(1))
    assert committed >= status["committed_round"] + 3
    assert re.search(r"identical across nodes at (\d+) of \1 outer steps", summary), summary

    # Any outer step with a checkpoint exports by number, and the export generates text.
    export = subprocess.run([sys.executable, "-m", "prime.tools.export", str(tmp_path / "run"), "--outer-step", "4", "--out",
                             str(tmp_path / "hf"), "--prompt", "def "], capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr
    assert "step_00000020" in export.stdout and "sample: 'def " in export.stdout
    missing = subprocess.run([sys.executable, "-m", "prime.tools.export", str(tmp_path / "run"), "--outer-step", "3",
                              "--out", str(tmp_path / "hf3")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "outer steps with one: " in missing.stderr

    # The export is an RL policy as it is: TOPLOC thresholds measured on it, then asynchronous GRPO with
    # every role a process, every rollout verified. The byte-level model knows no reversing yet, so a
    # format term (a digit anywhere) gives its groups something to tell apart.
    calibrate(tmp_path / "hf", ["--threads", "1", "--batch-sizes", "1,8", "--rollouts", "16", "--max-tokens", "8",
                                "--margin", "16", "--topk", "32"])  # the debug model is 64 wide
    rl = RLCluster(tmp_path / "rl", tmp_path / "hf", orchestrator_sets=[
        "prompts_per_step=4", "prompts_per_lease=2", "eval_every=2", "poll_s=2", "async_level=1",
        "reward_terms.format_regex='[0-9]'", "reward_terms.format_weight=0.5",
        # The format term decides only if some sample writes a digit; in one CI run none did and every
        # group was flat, so every batch was empty. Flat groups kept: the trainer always gets rows.
        "filter.drop_flat=false"], trainer_sets=["max_steps=3"])
    with rl:
        rl.start(["worker"])
        assert rl.wait("orchestrator", 240) == 0, rl.log("orchestrator")[-3000:]
    summary = rl.summary()
    assert summary["versions"] == 3 and summary["rollouts_rejected"] == 0, summary
    assert summary["rollouts_accepted"] >= 3 * 4 * 8, summary
    trained = [json.loads(line) for line in (tmp_path / "rl" / "trainer" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in trained] == [1, 2, 3] and any(r.get("rows", 0) > 0 for r in trained), trained


def test_report_of_a_single_node_run_and_of_a_wrong_directory(tmp_path):
    from tests.conftest import run_train

    run_train(["--config", "configs/debug.toml", "--run-dir", str(tmp_path / "single"), "--train.max_steps", "10",
               "--checkpoint.every", "0"])
    with open(tmp_path / "single" / "metrics.jsonl", "a") as f:
        f.write('{"step": 11, "loss": 2.0, "tok')  # a line cut short by a crash
    done = subprocess.run([sys.executable, "-m", "prime.tools.report", str(tmp_path / "single")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "is not JSON" in done.stderr
    assert "| single | 10 |" in (tmp_path / "single" / "report" / "summary.md").read_text()
    (tmp_path / "empty").mkdir()
    wrong = subprocess.run([sys.executable, "-m", "prime.tools.report", str(tmp_path / "empty")], capture_output=True,
                           text=True, timeout=120)
    assert wrong.returncode == 2 and "no metrics.jsonl" in wrong.stderr


def test_dashboard_files_are_only_the_packaged_ones(tmp_path):
    from elastic_mesh.coordinator.run import start_coordinator

    server = start_coordinator(tmp_path / "coord")
    try:
        for path, kind in [("/", "text/html"), ("/dashboard.js", "javascript"), ("/charts.js", "javascript"),
                           ("/dashboard.css", "text/css")]:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=10) as response:
                assert kind in response.headers["Content-Type"] and response.read()
        for path in ("/../coordinator.sqlite", "/secret", "/%2e%2e/secret", "/dashboard/index.html"):
            with pytest.raises(urllib.error.HTTPError) as missing:
                urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=10)
            assert missing.value.code == 404
    finally:
        server.stop()


def test_dashboard_shows_broadcast_versions_holders_and_bytes_served(tmp_path, chromium):
    import torch

    from elastic_mesh.broadcast.member import BroadcastMember, BroadcastSettings
    from elastic_mesh.coordinator.run import make_token, start_coordinator

    server = start_coordinator(tmp_path / "coord")
    settings = BroadcastSettings(host="127.0.0.1", chunk_mb=0.25)
    origin = BroadcastMember(make_token(tmp_path / "coord", 600, publish=True), "policy", tmp_path / "o", settings)
    worker = make_token(tmp_path / "coord", 600, role="worker", max_nodes=2)
    members = [BroadcastMember(worker, "policy", tmp_path / f"m{i}", settings) for i in range(2)]
    try:
        origin.publish(3, {"w": torch.randn(500_000)})
        for m in members:
            m.fetch()
        wait_for(lambda: server.coordinator.broadcasts.summary()[0]["complete"] == 3, 30, "three complete holders")
        observer = make_token(tmp_path / "coord", 600, role="observer")
        dom = render(chromium, f"http://127.0.0.1:{server.port}/#token={observer}")
    finally:
        for m in [origin, *members]:
            m.stop()
        server.stop()
    row = re.search(r'<tr data-broadcast="policy/3">(.*?)</tr>', dom, re.S)
    assert row, "no row for policy version 3"
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row.group(1))
    assert cells[0] == "policy" and cells[1] == "3" and cells[3] == "2.0" and cells[6] == "3" and cells[7] == "3"
