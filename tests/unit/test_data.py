"""Data: real files through `datasets`, packing with EOS, disjoint ranks, exact resume."""

import itertools
import json
import subprocess
import sys

import pytest
import torch

from prime.data.loader import (
    BatchIterator,
    DataConfig,
    DataPosition,
    PackedSequenceStream,
    eval_shards,
    pack_shard,
    train_and_eval_files,
    worker_shards,
)
from prime.data.shards import Shard, iter_documents, iter_records, make_shards
from prime.data.tokenizer import ByteTokenizer
from tests.conftest import REPO, child_env


def _write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(docs)))
    return path


def test_packing_joins_documents_with_eos(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", ["abc", "defgh", "ij"])
    tok = ByteTokenizer()
    stream = PackedSequenceStream([Shard(str(tmp_path / "a.jsonl"))], tok, seq_len=4, loop=False)
    windows = [w.tolist() for w in stream]
    eos = tok.eos_id
    flat = [*b"abc", eos, *b"defgh", eos, *b"ij", eos]
    # Windows of seq_len + 1 that overlap by one token (the last input's label is the next window's first).
    assert windows == [flat[0:5], flat[4:9], flat[8:13]]


def test_builtin_corpus_is_real_text(corpus):
    train, evals = train_and_eval_files(DataConfig(path=str(corpus)))
    assert len(train) == 8 and len(evals) == 1
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert manifest["train_documents"] > 300 and manifest["eval_documents"] > 0
    train_ids = {json.loads(line)["id"] for f in train for line in open(f)}
    eval_ids = {json.loads(line)["id"] for f in evals for line in open(f)}
    assert not train_ids & eval_ids
    assert any("import" in text for _, text in iter_documents(Shard(train[0]), "text"))


def test_ranks_read_disjoint_documents(corpus):
    train, _ = train_and_eval_files(DataConfig(path=str(corpus)))
    seen = []
    for rank in range(3):
        docs = set()
        for shard in worker_shards(DataConfig(parts_per_file=2), train, rank, 3):
            docs |= {doc_id for _, _, doc_id in iter_records(shard, "text")}
        seen.append(docs)
    assert sum(map(len, seen)) > 300
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2]) and not (seen[0] & seen[2])


def test_too_few_shards_for_workers_is_explained(corpus):
    train, _ = train_and_eval_files(DataConfig(path=str(corpus)))
    with pytest.raises(ValueError, match="raise data.parts_per_file to at least 2"):
        worker_shards(DataConfig(), train, 0, 16)


@pytest.mark.parametrize("interleave", [1, 4])
def test_resume_sees_exactly_the_same_batches(corpus, interleave):
    train, _ = train_and_eval_files(DataConfig(path=str(corpus)))
    shards = worker_shards(DataConfig(), train, 1, 2)
    tok = ByteTokenizer()
    straight = BatchIterator(PackedSequenceStream(shards, tok, seq_len=128, interleave=interleave, seed=3),
                             micro_batch_size=4)
    expected, positions = [], []
    for _ in range(60):
        expected.append(next(straight)[0])
        positions.append(straight.position.to_dict())
    # Positions cross document and shard boundaries within these 60 batches.
    assert len({h[1] for p in positions for h in p["heads"]}) > 1
    assert {len(p["heads"]) for p in positions} == {interleave}
    for cut in (7, 31):
        resumed = BatchIterator(PackedSequenceStream(shards, tok, 128, position=DataPosition.from_dict(
            json.loads(json.dumps(positions[cut]))), interleave=interleave, seed=3), micro_batch_size=4)
        for i in range(cut + 1, 60):
            assert torch.equal(next(resumed)[0], expected[i]), f"batch {i} differs after resuming at {cut}"


def test_interleaving_mixes_shards_in_each_batch_and_reads_each_one_in_order(corpus):
    """A batch draws from several shards in a seeded order; every shard is still read front to back, each
    window exactly once, so the windows are those of sequential reading, only reordered."""
    train, _ = train_and_eval_files(DataConfig(path=str(corpus)))
    shards = worker_shards(DataConfig(), train, 0, 2)  # 4 shards
    tok = ByteTokenizer()
    per_shard = [[w.tolist() for w, _ in itertools.islice(pack_shard(s, tok, 64, "text"), 400)] for s in shards]
    owner = {tuple(w): (k, i) for k, windows in enumerate(per_shard) for i, w in enumerate(windows)}
    stream = iter(PackedSequenceStream(shards, tok, 64, interleave=4, seed=11))
    drawn = [owner[tuple(next(stream).tolist())] for _ in range(400)]
    for k in range(4):  # each shard's windows come in its own order, none skipped or repeated
        mine = [i for shard, i in drawn if shard == k]
        assert mine == list(range(len(mine))) and len(mine) > 40, (k, len(mine))
    batches = [{shard for shard, _ in drawn[b:b + 8]} for b in range(0, 400, 8)]
    assert sum(len(b) for b in batches) / len(batches) > 2.5  # 8 windows from ~3.3 shards on average
    other = iter(PackedSequenceStream(shards, tok, 64, interleave=4, seed=12))
    assert [owner[tuple(next(other).tolist())] for _ in range(400)] != drawn  # the seed changes the order


def test_a_position_written_before_interleaving_resumes_where_it_was(corpus):
    train, _ = train_and_eval_files(DataConfig(path=str(corpus)))
    shards = worker_shards(DataConfig(), train, 0, 2)
    tok = ByteTokenizer()
    old = {"epoch": 0, "shard": 1, "document": 0, "offset": 0}
    position = DataPosition.from_dict(old, len(shards))
    assert position.heads == [[1, 0, 0]] and position.next_ticket == 2
    resumed = iter(PackedSequenceStream(shards, tok, 64, position=position))
    assert torch.equal(next(resumed), next(pack_shard(shards[1], tok, 64, "text"))[0])
    with pytest.raises(ValueError, match="shard count"):
        DataPosition.from_dict(old)


def test_epochs_wrap_around(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", ["x" * 30, "y" * 30])
    stream = PackedSequenceStream([Shard(str(tmp_path / "a.jsonl"))], ByteTokenizer(), seq_len=10)
    it = iter(stream)
    for _ in range(8):
        next(it)
    assert stream.position.epoch(1) >= 1


def test_parquet_and_text_files(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"content": ["parquet doc one", "parquet doc two"]}).to_parquet(tmp_path / "p.parquet")
    (tmp_path / "t.txt").write_text("a whole text file is one document\nwith lines")
    docs = [t for _, t in iter_documents(Shard(str(tmp_path / "p.parquet")), "content")]
    assert docs == ["parquet doc one", "parquet doc two"]
    text = [t for _, t in iter_documents(Shard(str(tmp_path / "t.txt")), "text")]
    assert text == ["a whole text file is one document\nwith lines"]


def test_missing_text_field_is_named(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(KeyError, match="set data.text_field"):
        list(iter_documents(Shard(str(tmp_path / "a.jsonl")), "text"))


def test_shards_split_a_file(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", [str(i) for i in range(10)])
    parts = make_shards([str(tmp_path / "a.jsonl")], 3)
    got = [[t for _, t in iter_documents(s, "text")] for s in parts]
    assert got == [["0", "3", "6", "9"], ["1", "4", "7"], ["2", "5", "8"]]
    assert eval_shards([str(tmp_path / "a.jsonl")], 1, 2) == [Shard(str(tmp_path / "a.jsonl"), 1, 2)]


READ_A_SHARD = """
import sys
if sys.argv[2] == "model first":
    import prime.core.model  # what a node imports before it reads: transformers, and with it huggingface_hub
from prime.data.shards import Shard, iter_documents

lookups = []
sys.addaudithook(lambda event, args: event in ("socket.getaddrinfo", "socket.connect") and lookups.append(args[:2]))
for _ in range(3):
    docs = [t for _, t in iter_documents(Shard(sys.argv[1]), "text")]
print(len(docs), lookups)
"""


@pytest.mark.parametrize("order", ["model first", "data first"])
def test_reading_a_local_shard_opens_no_connection(tmp_path, order):
    """`datasets` counts a download with a HEAD to the hub on every open, local files included, and its
    off switch is read at import time: a node paid a DNS lookup per shard lease (a timeout where DNS
    hangs). Run the way a node runs (model code imported first) and the other way round, each in its own
    interpreter: an audit hook sees every lookup and connection."""
    _write_jsonl(tmp_path / "a.jsonl", ["one", "two"])
    result = subprocess.run([sys.executable, "-c", READ_A_SHARD, str(tmp_path / "a.jsonl"), order], cwd=REPO,
                            env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["2", "[]"], result.stdout
