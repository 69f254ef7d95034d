"""Streams token sequences for one data-parallel worker: tokenize on the fly, pack with EOS, resume exactly.

Each worker owns a disjoint list of shards and walks them epoch after epoch. Documents are tokenized,
joined with EOS and cut into windows of seq_len + 1 tokens (inputs and shifted labels); windows overlap
by one token so no token is lost as a label. Tokens left over at the end of a shard are dropped.

A worker reads `data.interleave` shards at once and draws each window from one of them in a seeded
random order (prime/data/interleave.py), so a batch mixes several documents. Its position is where
each open shard is (shard, document, token offset) and which shard opens next, so a resumed worker
yields exactly the batches an uninterrupted one would have.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from prime.data.interleave import ReadHeads
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
    interleave: int = Field(8, ge=1, le=256, description="Shards each worker reads at once; every sequence of a "
                            "batch is drawn from one of them in a seeded random order. 1: one shard front to back.")
    seed: int = Field(0, ge=0, description="Seed of the order sequences are drawn in (the same shards in another order).")


@dataclass
class DataPosition:
    """Where a worker is: everything needed to continue exactly. A shard is opened by a ticket: ticket t
    reads the worker's shard t % n in epoch t // n."""

    heads: list[list[int]] = field(default_factory=list)  # [ticket, document, token offset] of each open shard
    next_ticket: int = 0

    def epoch(self, shards: int) -> int:
        """The oldest epoch still being read by a worker of `shards` shards."""
        return min((h[0] for h in self.heads), default=self.next_ticket) // shards

    def to_dict(self) -> dict:
        return {"heads": [list(h) for h in self.heads], "next_ticket": self.next_ticket}

    @classmethod
    def from_dict(cls, data: dict, shards: int | None = None) -> "DataPosition":
        if "heads" in data:
            heads = [[int(v) for v in h] for h in data["heads"]]
            if any(len(h) != 3 for h in heads):
                raise ValueError(f"a data position's heads are [ticket, document, offset], got {data['heads']}")
            return cls(heads, int(data["next_ticket"]))
        # Written before interleaving (one shard at a time): the same place, read with data.interleave = 1.
        if shards is None:
            raise ValueError("a data position of the old form needs the worker's shard count")
        ticket = int(data["epoch"]) * shards + int(data["shard"])
        return cls([[ticket, int(data["document"]), int(data["offset"])]], ticket + 1)


class PackedSequenceStream:
    """Yields tensors of seq_len + 1 token ids for one worker, and can say where it is."""

    def __init__(self, shards: list[Shard], tokenizer: Tokenizer, seq_len: int, text_field: str = "text",
                 position: DataPosition | None = None, loop: bool = True, interleave: int = 1,
                 seed: int = 0) -> None:
        if not shards:
            raise ValueError("a data stream needs at least one shard")
        self.shards, self.tokenizer, self.seq_len = shards, tokenizer, seq_len
        self.text_field, self.loop = text_field, loop
        self.interleave, self.seed = min(interleave, len(shards)), seed
        self.position = position or DataPosition()

    def _windows(self, head: list[int]):
        return pack_shard(self.shards[head[0] % len(self.shards)], self.tokenizer, self.seq_len, self.text_field,
                          head[1], head[2])

    def __iter__(self) -> Iterator[torch.Tensor]:
        n = len(self.shards)
        heads: ReadHeads[list[int]] = ReadHeads(self.seed, tuple)
        ticket = self.position.next_ticket
        live: list[list[int]] = []
        for head in self.position.heads:
            head = list(head)
            if heads.add(head, self._windows(head)):
                live.append(head)
        empty = 0

        def top_up() -> None:
            nonlocal ticket, empty
            while len(live) < self.interleave and (self.loop or ticket < n):
                head, ticket = [ticket, 0, 0], ticket + 1
                if heads.add(head, self._windows(head)):
                    live.append(head)
                    empty = 0
                    continue
                empty += 1
                if empty >= n:
                    raise ValueError(
                        f"no shard of this worker ({', '.join(s.name for s in self.shards[:4])}...) holds "
                        f"{self.seq_len + 1} tokens; give more text or a smaller train.seq_len"
                    )

        top_up()
        while heads:
            head, sample, (document, offset), windows = heads.take()
            head[1], head[2] = document, offset
            if not heads.add(head, windows):
                live.remove(head)
                top_up()
            # Recorded after the read-ahead: a stream resumed here re-reads the same windows ahead.
            self.position = DataPosition([list(h) for h in live], ticket)
            yield sample


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
        self._ahead: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def position(self) -> DataPosition:
        if self._ahead is not None:  # the stream is a batch further than what was taken
            raise RuntimeError("a batch read ahead is not taken yet: the position would skip it")
        return self.stream.position  # a PackedSequenceStream's; leased streams report to the coordinator

    def __iter__(self) -> "BatchIterator":
        return self

    def read_ahead(self) -> None:
        """Reads the next micro-batch now, for the next __next__ to return: the stream's first reads
        (its leases, its files opened and tokenized) happen here instead of inside a step."""
        if self._ahead is None:
            self._ahead = self._read()

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._ahead is not None:
            batch, self._ahead = self._ahead, None
            return batch
        return self._read()

    def _read(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [next(self._samples) for _ in range(self.micro_batch_size)]
        batch = torch.stack(rows)  # (B, T+1)
        return batch[:, :-1], batch[:, 1:]
