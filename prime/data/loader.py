"""Streams token sequences for one data-parallel worker: tokenize on the fly, pack with EOS, resume exactly.

Each worker owns a disjoint list of shards and walks them in order, epoch after epoch. Documents are
tokenized, joined with EOS and cut into windows of seq_len + 1 tokens (inputs and shifted labels);
windows overlap by one token so no token is lost as a label. Tokens left over at the end of a shard
are dropped, so a position is fully described by (epoch, shard, document, token offset) and a resumed
worker yields exactly the batches an uninterrupted one would have.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Iterator, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from prime.data.shards import Shard, iter_documents, make_shards, resolve_files
from prime.data.tokenizer import Tokenizer


class DataConfig(BaseModel):
    """Where the text comes from and how it is cut."""

    model_config = ConfigDict(extra="forbid")

    source: Literal["builtin", "files", "hub"] = Field(
        "builtin", description="builtin: the Python stdlib corpus (prepared on first use); files: data.path; "
        "hub: a Hugging Face dataset name (needs network)."
    )
    path: str | None = Field(None, description="files: a file, directory or glob (jsonl, parquet, txt). "
                             "builtin: the corpus cache directory (default ~/.cache/prime/...).")
    eval_path: str | None = Field(None, description="files: held-out files for eval; required with source=files.")
    hub_name: str | None = Field(None, description="hub: dataset name, e.g. 'HuggingFaceFW/fineweb-edu'.")
    text_field: str = Field("text", description="Field of each record that holds the document text.")
    tokenizer: str = Field("byte", description="'byte' (built-in, vocab 259) or a local tokenizer.json / directory.")
    parts_per_file: int = Field(1, ge=1, description="Shards cut from each file (document i goes to part i % n).")


@dataclass
class DataPosition:
    """Where a worker is: everything needed to continue exactly."""

    epoch: int = 0
    shard: int = 0  # index into the worker's own shard list
    document: int = 0  # first document of the shard not yet fully consumed
    offset: int = 0  # tokens of that document (EOS included) already consumed

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DataPosition":
        return cls(**{k: int(data[k]) for k in ("epoch", "shard", "document", "offset")})


class PackedSequenceStream:
    """Yields tensors of seq_len + 1 token ids for one worker, and can say where it is."""

    def __init__(self, shards: list[Shard], tokenizer: Tokenizer, seq_len: int, text_field: str = "text",
                 position: DataPosition | None = None, loop: bool = True) -> None:
        if not shards:
            raise ValueError("a data stream needs at least one shard")
        self.shards, self.tokenizer, self.seq_len = shards, tokenizer, seq_len
        self.text_field, self.loop = text_field, loop
        self.position = position or DataPosition()

    def __iter__(self) -> Iterator[torch.Tensor]:
        empty_shards = 0
        while True:
            pos = self.position
            produced = False
            for sample, (document, offset) in pack_shard(self.shards[pos.shard], self.tokenizer, self.seq_len,
                                                         self.text_field, pos.document, pos.offset):
                self.position = DataPosition(pos.epoch, pos.shard, document, offset)
                produced = True
                yield sample
            empty_shards = 0 if produced else empty_shards + 1
            if empty_shards >= len(self.shards):
                raise ValueError(
                    f"no shard of this worker ({', '.join(s.name for s in self.shards[:4])}...) holds "
                    f"{self.seq_len + 1} tokens; give more text or a smaller train.seq_len"
                )
            shard, epoch = pos.shard + 1, pos.epoch
            if shard == len(self.shards):
                if not self.loop:
                    return
                shard, epoch = 0, epoch + 1
            self.position = DataPosition(epoch, shard, 0, 0)


def pack_shard(shard: Shard, tokenizer: Tokenizer, seq_len: int, text_field: str, document: int = 0,
               offset: int = 0) -> Iterator[tuple[torch.Tensor, tuple[int, int]]]:
    """Windows of seq_len + 1 tokens of one shard from (document, token offset) on, each with the
    position right after it (the first token not consumed yet). Tokens left at the shard's end that do
    not fill a window are dropped."""
    window = seq_len + 1
    buf: list[int] = []
    head = 0  # buf[head:] is what has not been consumed yet
    spans: deque[list[int]] = deque()  # [document, first token of it in buf, tokens] over buf[head:]
    for doc_index, text in iter_documents(shard, text_field, start=document):
        tokens = tokenizer.encode(text)
        tokens.append(tokenizer.eos_id)
        skip = offset if doc_index == document else 0
        spans.append([doc_index, skip, len(tokens) - skip])
        buf.extend(tokens[skip:])
        while len(buf) - head >= window:
            sample = torch.tensor(buf[head:head + window], dtype=torch.long)
            head += seq_len
            _advance(spans, seq_len)
            if head > 1 << 16:
                buf, head = buf[head:], 0
            yield sample, (spans[0][0], spans[0][1])


def _advance(spans: deque[list[int]], n: int) -> None:
    """Marks the first n buffered tokens as consumed."""
    while n:
        span = spans[0]
        if span[2] > n:
            span[1] += n
            span[2] -= n
            return
        n -= span[2]
        spans.popleft()


def worker_shards(config: DataConfig, corpus_files: list[str], worker: int, workers: int) -> list[Shard]:
    """The shards data-parallel worker `worker` of `workers` reads: a disjoint, strided slice."""
    shards = make_shards(corpus_files, config.parts_per_file)
    if len(shards) < workers:
        raise ValueError(
            f"{len(shards)} data shards cannot feed {workers} workers without overlap; "
            f"raise data.parts_per_file to at least {-(-workers * config.parts_per_file // len(shards))}"
        )
    return shards[worker::workers]


def eval_shards(eval_files: list[str], worker: int, workers: int) -> list[Shard]:
    # Eval files are few and small: stripe their documents across workers instead.
    return [Shard(f, worker, workers) for f in eval_files]


def train_and_eval_files(config: DataConfig) -> tuple[list[str], list[str]]:
    if config.source == "builtin":
        from prime.data.builtin_corpus import prepare

        root = prepare(config.path)
        return resolve_files(str(root / "train-*.jsonl"), "built-in corpus"), resolve_files(
            str(root / "eval-*.jsonl"), "built-in corpus")
    if config.source == "files":
        if not config.path:
            raise ValueError("data.source = 'files' needs data.path (a file, directory or glob)")
        if not config.eval_path:
            raise ValueError("data.source = 'files' needs data.eval_path, held-out files for the eval loss")
        return resolve_files(config.path, "data.path"), resolve_files(config.eval_path, "data.eval_path")
    return hub_files(config.hub_name)


def hub_files(name: str) -> tuple[list[str], list[str]]:
    """A hub dataset's files (read remotely by `datasets`); the last one is held out for eval."""
    import datasets

    try:
        builder = datasets.load_dataset_builder(name)
    except Exception as e:  # the hub client raises many types for "unreachable"
        raise FileNotFoundError(
            f"data.hub_name {name!r} could not be resolved ({type(e).__name__}: {e}); without network access, "
            "download it elsewhere and use data.source = 'files'"
        ) from None
    files = sorted(str(f) for f in (builder.config.data_files or {}).get("train", []))
    if len(files) < 2:
        raise ValueError(f"hub dataset {name!r} lists {len(files)} train file(s); it needs 2+ (one is held out)")
    return files[:-1], files[-1:]


class BatchIterator:
    """Groups packed sequences into (inputs, labels) micro-batches of shape (micro_batch_size, seq_len)."""

    def __init__(self, stream: PackedSequenceStream, micro_batch_size: int) -> None:
        self.stream, self.micro_batch_size = stream, micro_batch_size
        self._samples = iter(stream)

    @property
    def position(self) -> DataPosition:
        return self.stream.position  # a PackedSequenceStream's; leased streams report to the coordinator

    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [next(self._samples) for _ in range(self.micro_batch_size)]
        batch = torch.stack(rows)  # (B, T+1)
        return batch[:, :-1], batch[:, 1:]
