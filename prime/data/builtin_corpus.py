"""The built-in corpus: the Python standard library's own sources, present on any machine with Python.

Each module is one document. It is cut into jsonl shards (train) plus one held-out eval file, written
atomically into a cache directory, so several processes may ask for it at once.

    python -m prime.data.builtin_corpus [--out DIR] [--shards 32]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
EVAL_PERCENT = 2  # of documents, chosen by a hash of their path, so the split is stable


def default_corpus_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    version = f"py{sys.version_info.major}.{sys.version_info.minor}"
    return cache / "prime" / f"builtin-corpus-{version}"


def _documents() -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIPPED_DIRS)
        for name in sorted(files):
            if name.endswith(".py"):
                path = Path(directory) / name
                text = path.read_text(encoding="utf-8", errors="replace")
                if text.strip():
                    docs.append((str(path.relative_to(root)), text))
    if not docs:
        raise RuntimeError(f"no Python sources found under {root}; point data.path at your own text files")
    return docs


def _is_eval(doc_id: str) -> bool:
    return int(hashlib.sha256(doc_id.encode()).hexdigest(), 16) % 100 < EVAL_PERCENT


def prepare(out: Path | None = None, shards: int = 32) -> Path:
    """Writes the corpus unless a complete copy is already there; returns its directory."""
    out = Path(out) if out else default_corpus_dir()
    if (out / "manifest.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        docs = _documents()
        train = [(i, d) for i, d in enumerate(docs) if not _is_eval(d[0])]
        evals = [(i, d) for i, d in enumerate(docs) if _is_eval(d[0])]
        files = [open(staging / f"train-{k:05d}.jsonl", "w", encoding="utf-8") for k in range(shards)]
        for position, (_, (doc_id, text)) in enumerate(train):
            files[position % shards].write(json.dumps({"id": doc_id, "text": text}) + "\n")
        for f in files:
            f.close()
        with open(staging / "eval-00000.jsonl", "w", encoding="utf-8") as f:
            for _, (doc_id, text) in evals:
                f.write(json.dumps({"id": doc_id, "text": text}) + "\n")
        manifest = {
            "source": "python standard library sources",
            "python": sys.version.split()[0],
            "train_documents": len(train),
            "eval_documents": len(evals),
            "bytes": sum(len(t.encode()) for _, t in docs),
            "shards": shards,
        }
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=2))
        try:
            staging.rename(out)
        except OSError:
            # Another process finished first; its copy is identical.
            if not (out / "manifest.json").exists():
                raise
        log.info("built-in corpus ready at %s: %d train / %d eval documents, %.1f MB",
                 out, len(train), len(evals), manifest["bytes"] / 1e6)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Prepare the built-in training corpus (the Python standard library's sources).",
        epilog="example: python -m prime.data.builtin_corpus --out /tmp/corpus --shards 16",
    )
    parser.add_argument("--out", type=Path, default=None, help=f"directory (default {default_corpus_dir()})")
    parser.add_argument("--shards", type=int, default=32, help="number of train shard files (default 32)")
    args = parser.parse_args(argv)
    if args.shards < 1:
        parser.error(f"--shards {args.shards} must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(prepare(args.out, args.shards))


if __name__ == "__main__":
    main()
