"""wandb in offline mode (no network): one run per node, grouped by the run id, documented metric names.

The offline run file is read back with a small reader of wandb's record log (the format's reader is no
longer shipped in Python), so the test checks what wandb actually stored, not what we asked it to.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest

from prime.core.metrics import MetricsConfig, MetricsWriter

pytest.importorskip("wandb", reason="wandb is in the dev extra; make test installs it")


def wandb_records(run_dir: Path, timeout_s: float = 30.0) -> list:
    """Every protobuf Record in the single offline run under run_dir/wandb, once the run's exit record is
    in it: wandb's writer runs in its own process and may still be flushing when finish() returns (once
    in a full suite run the file held nothing yet)."""
    files = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    deadline = time.monotonic() + timeout_s
    while True:
        records = _read_records(files[0].read_bytes())
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def _read_records(data: bytes) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    pos, block, pending, out = 7, 32768, b"", []
    if len(data) < 7:  # not even the header written yet
        return out
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer: too short for a record header
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        if pos + 7 + length > len(data):  # a record still being written
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def history(records) -> list[dict]:
    # "train/loss" is stored as the nested key ["train", "loss"].
    return [{i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def test_single_node_run_logs_train_and_eval_metrics_offline(tmp_path):
    from tests.conftest import run_train

    run_train(["--config", "configs/debug.toml", "--run-dir", str(tmp_path), "--train.max_steps", "10",
               "--checkpoint.every", "0", "--metrics.wandb", "true"])
    records = wandb_records(tmp_path)
    rows = history(records)
    steps = [int(r["_step"]) for r in rows if "train/loss" in r]
    assert steps == list(range(1, 11))
    assert any("eval/loss" in r for r in rows)
    assert {"train/lr", "train/tokens", "train/tokens_per_s", "train/grad_norm"} <= set(rows[0])


def test_a_node_is_one_run_named_after_it_and_grouped_by_the_run_id(tmp_path):
    writer = MetricsWriter(tmp_path, MetricsConfig(wandb=True, wandb_mode="offline"), "cpu-demo", enabled=True)
    writer.name_run("node3", group="run-abc123")
    writer.write({"step": 5, "loss": 3.2, "tokens": 100})
    writer.write({"step": 5, "outer_step": 1, "allreduce_s": 0.4, "bytes_sent": 1000, "members": 2,
                  "model_hash": "ab12", "refused": []})
    writer.close()
    records = wandb_records(tmp_path)
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    kinds = [r.WhichOneof("record_type") for r in records]
    assert runs, f"no run record in the offline file; its records: {kinds[:40]}"
    run = runs[0]
    assert (run.display_name, run.run_group, run.job_type) == ("node3", "run-abc123", "node")
    rows = history(records)
    assert any(r.get("outer/allreduce_s") == "0.4" and r.get("outer/members") == "2" for r in rows), rows
    with pytest.raises(RuntimeError, match="before the first record"):
        writer.name_run("late", group="x")
