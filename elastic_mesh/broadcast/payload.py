"""Files as a broadcast payload: each file travels as a uint8 tensor named by its path relative to the
published root, and is written back under the same relative path (never outside the output folder)."""

from __future__ import annotations

from pathlib import Path

import torch

from elastic_mesh.transfer.chunk_dir import ChunkDir

FILES_META = "files"


def files_as_tensors(paths: list[Path]) -> tuple[dict[str, torch.Tensor], dict]:
    """The files (a folder: every file under it) as named tensors, and the meta that marks them files."""
    tensors: dict[str, torch.Tensor] = {}
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        root = path if path.is_dir() else path.parent
        for file in sorted(path.rglob("*") if path.is_dir() else [path]):
            if file.is_file():
                name = file.relative_to(root).as_posix()
                if name in tensors:
                    raise ValueError(f"two files would be published as {name!r}; publish them from one folder")
                data = bytearray(file.read_bytes())
                tensors[name] = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    if not tensors:
        raise ValueError(f"no files under {', '.join(map(str, paths))}")
    return tensors, {FILES_META: sorted(tensors)}


def read_files(target: ChunkDir) -> dict[str, memoryview]:
    """A complete version's files by name, in memory (their bytes verified chunk by chunk): views into
    one buffer, so a large version is not held twice."""
    names = set(target.manifest.get("meta", {}).get(FILES_META, []))
    if not names:
        raise ValueError(f"{target.manifest.get('kind', '')} {target.version} holds tensors, not files")
    blob = memoryview(target.read_all())
    return {entry["name"]: blob[entry["offset"]:entry["offset"] + entry["nbytes"]]
            for entry in target.manifest["tensors"] if entry["name"] in names}


def write_files(target: ChunkDir, out: Path) -> list[Path]:
    """Writes a complete version's files under `out`; a name that would land outside it is refused."""
    out = Path(out).resolve()
    written = []
    for name, data in read_files(target).items():
        path = (out / name).resolve()
        if out not in path.parents:
            raise ValueError(f"file name {name!r} would be written outside {out}; refused")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written.append(path)
    return written
