"""Shards: the units the corpus is cut into, and a reader that streams one shard's documents.

A shard is (file, part, parts): document i of the file belongs to it when i % parts == part. Many
shards per file let a few large files feed many ranks (and, later, be leased to many nodes).
Files are read with `datasets` in streaming mode, so nothing is materialised on disk.
"""

from __future__ import annotations

import glob
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".md": "text"}


@dataclass(frozen=True, order=True)
class Shard:
    file: str
    part: int = 0
    parts: int = 1

    @property
    def name(self) -> str:
        return f"{Path(self.file).name}#{self.part}/{self.parts}"


def resolve_files(pattern: str, what: str) -> list[str]:
    """Files named by a path, a directory (all supported files inside) or a glob, sorted."""
    path = Path(pattern).expanduser()
    if path.is_dir():
        files = sorted(str(p) for p in path.iterdir() if p.suffix in _FORMATS)
    elif path.is_file():
        files = [str(path)]
    else:
        files = sorted(glob.glob(str(path)))
    if not files:
        raise FileNotFoundError(
            f"{what} {pattern!r} matches no data files; give a file, a directory or a glob of "
            f"{', '.join(sorted(_FORMATS))} files"
        )
    unknown = [f for f in files if Path(f).suffix not in _FORMATS]
    if unknown:
        raise ValueError(f"{what}: unsupported file type {unknown[0]!r}; use one of {', '.join(sorted(_FORMATS))}")
    return files


def data_fingerprint(files: list[str], parts_per_file: int) -> str:
    """Same on every node that reads the same files cut the same way (paths may differ between machines)."""
    h = hashlib.blake2b(digest_size=8)
    for f in files:
        size = Path(f).stat().st_size if Path(f).is_file() else -1
        h.update(f"{Path(f).name}:{size};".encode())
    h.update(str(parts_per_file).encode())
    return h.hexdigest()


def make_shards(files: list[str], parts_per_file: int) -> list[Shard]:
    return [Shard(f, p, parts_per_file) for f in files for p in range(parts_per_file)]


def iter_documents(shard: Shard, text_field: str, start: int = 0) -> Iterator[tuple[int, str]]:
    """(index within the shard, text) of every document of `shard` from document `start` on."""
    for index, text, _ in iter_records(shard, text_field, start):
        yield index, text


def iter_records(shard: Shard, text_field: str, start: int = 0) -> Iterator[tuple[int, str, str]]:
    """(index within the shard, text, document id) from document `start` on.

    The id is the record's own "id" field when it has one, else "file:line", so it is stable.
    """
    import datasets

    datasets.logging.set_verbosity_error()
    # `load_dataset` sends a HEAD to the hub's bucket to count a download on every open, even of a local
    # file: 50 ms each here, up to its 3 s timeout on a node whose DNS hangs, once per shard lease. The
    # variable that turns it off is read when `datasets` is first imported (by then often already done,
    # by `transformers`), so it is set where it is read.
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    builder = _FORMATS[Path(shard.file).suffix]
    kwargs = {"sample_by": "document"} if builder == "text" else {}
    stream = datasets.load_dataset(builder, data_files=shard.file, split="train", streaming=True, **kwargs)
    field = "text" if builder == "text" else text_field
    index = -1
    for file_index, example in enumerate(stream):
        if file_index % shard.parts != shard.part:
            continue
        index += 1
        if index < start:
            continue
        if field not in example:
            raise KeyError(
                f"{shard.file}: document {file_index} has no field {field!r} (fields: {sorted(example)}); "
                f"set data.text_field to the field that holds the text"
            )
        text = example[field]
        if not isinstance(text, str):
            raise TypeError(f"{shard.file}: document {file_index} field {field!r} is {type(text).__name__}, not text")
        yield index, text, str(example.get("id", f"{Path(shard.file).name}:{file_index}"))
