"""One node trains for real: torchrun, 2 ranks, FSDP2 over Gloo, checkpoints, resume, export."""

import shutil

import pytest
import torch

from prime.config import load_config
from prime.core.checkpoint import CheckpointStore
from prime.core.model import build_model
from tests.conftest import REPO, read_metrics, run_train


@pytest.fixture(scope="module")
def two_rank_run(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run") / "two_ranks"
    run_train(["--config", "configs/debug.toml", "--run-dir", str(run_dir), "--data.path", str(corpus),
               "--train.max_steps", "40", "--checkpoint.every", "10", "--checkpoint.keep", "2",
               "--train.eval_every", "20"], nproc=2)
    return run_dir


def test_loss_falls_with_fsdp2_on_two_ranks(two_rank_run):
    records = read_metrics(two_rank_run)
    steps = [r for r in records if "loss" in r]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 41))
    assert all({"step", "loss", "lr", "tokens", "tokens_per_s"} <= set(r) for r in steps)
    first, last = sum(r["loss"] for r in steps[:5]) / 5, sum(r["loss"] for r in steps[-5:]) / 5
    assert last < first - 1.0, (first, last)
    assert len(evals) == 2 and evals[1] < evals[0]
    assert steps[-1]["tokens"] == 40 * 8 * 64


def test_only_the_newest_checkpoints_are_kept(two_rank_run):
    names = sorted(p.name for p in (two_rank_run / "checkpoints").iterdir())
    assert names == ["step_00000030", "step_00000040"]


def test_resume_is_bit_identical_on_two_ranks(two_rank_run, corpus, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(two_rank_run / "checkpoints" / "step_00000030", resumed / "checkpoints" / "step_00000030")
    # A save that crashed half-way leaves only a hidden staging directory; it must be ignored.
    (resumed / "checkpoints" / ".step_00000035.tmp").mkdir()
    (resumed / "checkpoints" / ".step_00000035.tmp" / "__0_0.distcp").write_bytes(b"partial")
    run_train(["--config", "configs/debug.toml", "--run-dir", str(resumed), "--data.path", str(corpus),
               "--train.max_steps", "40", "--checkpoint.every", "10", "--train.eval_every", "20", "--resume"], nproc=2)
    original = {r["step"]: r for r in read_metrics(two_rank_run) if "loss" in r}
    again = {r["step"]: r for r in read_metrics(resumed) if "loss" in r}
    assert sorted(again) == list(range(31, 41))
    for step in again:
        assert again[step]["loss"] == original[step]["loss"], f"step {step} differs after resume"
    for shard in ("__0_0.distcp", "__1_0.distcp"):
        a = (two_rank_run / "checkpoints" / "step_00000040" / shard).read_bytes()
        b = (resumed / "checkpoints" / "step_00000040" / shard).read_bytes()
        assert a == b, f"{shard} of the resumed run differs from the uninterrupted run"


def test_background_checkpoints_equal_synchronous_ones_and_reach_the_remote_copy(two_rank_run, corpus, tmp_path):
    """two_rank_run wrote its checkpoints in the background (the default) while it kept training; the same
    run written synchronously gives the same bytes, so the background copy held the state of its step.
    The synchronous run also copies every checkpoint to a 'remote' path with fsspec."""
    sync_dir, remote = tmp_path / "sync", tmp_path / "remote"
    run_train(["--config", "configs/debug.toml", "--run-dir", str(sync_dir), "--data.path", str(corpus),
               "--train.max_steps", "40", "--checkpoint.every", "10", "--checkpoint.keep", "2",
               "--train.eval_every", "20", "--checkpoint.background", "false",
               "--checkpoint.remote", f"file://{remote}"], nproc=2)
    background, synchronous = two_rank_run / "checkpoints" / "step_00000040", sync_dir / "checkpoints" / "step_00000040"
    for shard in ("__0_0.distcp", "__1_0.distcp"):
        assert (background / shard).read_bytes() == (synchronous / shard).read_bytes(), shard
    assert sorted(p.name for p in remote.iterdir()) == [f"step_000000{k}0" for k in (1, 2, 3, 4)]  # none pruned
    copied = remote / "step_00000040"
    local_files = sorted(p.relative_to(synchronous) for p in synchronous.rglob("*") if p.is_file())
    assert sorted(p.relative_to(copied) for p in copied.rglob("*") if p.is_file()) == local_files
    assert all((copied / f).read_bytes() == (synchronous / f).read_bytes() for f in local_files)


def test_latest_ignores_partial_saves(tmp_path):
    store = CheckpointStore(tmp_path, keep=2, rank=0, world_size=1)
    (tmp_path / "step_00000010").mkdir()
    (tmp_path / "step_00000010" / "trainer.json").write_text("{}")
    (tmp_path / ".step_00000020.tmp").mkdir()
    assert store.latest() == tmp_path / "step_00000010"


def test_hf_export_of_a_sharded_checkpoint(two_rank_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from prime.tools.export import main as export_main

    checkpoint = two_rank_run / "checkpoints" / "step_00000040"
    assert export_main([str(checkpoint), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").exists()
    config = load_config(REPO / "configs/debug.toml")
    ours = build_model(config.model, seed=99, device="cpu")
    CheckpointStore.load_model(checkpoint, ours)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    inputs = torch.randint(0, 259, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(input_ids=inputs).logits, theirs(input_ids=inputs).logits)


def test_exported_tokenizer_gives_our_ids_and_generate_writes_text(two_rank_run, tmp_path):
    from transformers import AutoTokenizer

    from prime.data.tokenizer import ByteTokenizer
    from prime.tools.export import export_checkpoint, sample

    out = export_checkpoint(two_rank_run / "checkpoints" / "step_00000040", tmp_path / "hf")
    theirs, ours = AutoTokenizer.from_pretrained(out), ByteTokenizer()
    text = "def f(x):\n\treturn x  # héllo, 世界 ✓\r\n"
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text)
    assert theirs.decode(ours.encode(text)) == text
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (ours.bos_id, ours.eos_id, ours.pad_id)
    continuation = sample(out, "import ", new_tokens=12)
    assert continuation.startswith("import ") and len(continuation.encode()) >= len("import ") + 1


def test_export_refuses_a_non_checkpoint(tmp_path, capsys):
    from prime.tools.export import main as export_main

    assert export_main([str(tmp_path), "--out", str(tmp_path / "hf")]) == 2
    assert "not a complete prime checkpoint" in capsys.readouterr().err


def test_export_gives_the_live_trainers_logits(corpus, tmp_path):
    from transformers import AutoModelForCausalLM

    from prime.core.distributed import close_local_group, init_local_group
    from prime.pretrain.trainer import Trainer
    from prime.tools.export import export_checkpoint

    config = load_config(REPO / "configs/debug.toml", {"data.path": str(corpus), "train.max_steps": "3"})
    group = init_local_group("cpu")  # a real one-rank Gloo group in this process
    try:
        trainer = Trainer(config, group, tmp_path / "run", quiet=True)
        trainer.run()
        trainer.close()
        checkpoint = trainer.checkpoints.latest()
        export_checkpoint(checkpoint, tmp_path / "hf")
        inputs = torch.randint(0, 259, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            live = trainer.model(input_ids=inputs).logits
            exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(input_ids=inputs).logits
        assert torch.equal(live, exported)
    finally:
        close_local_group()


def test_activation_checkpointing_and_z_loss_under_fsdp2(corpus, tmp_path):
    run_train(["--config", "configs/debug.toml", "--run-dir", str(tmp_path / "run"), "--data.path", str(corpus),
               "--train.max_steps", "12", "--train.activation_checkpointing", "true", "--train.z_loss", "1e-4",
               "--train.eval_every", "0", "--checkpoint.every", "0"], nproc=2)
    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.5
