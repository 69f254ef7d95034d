"""Package boundaries that the design depends on."""

import ast
from pathlib import Path

from tests.conftest import REPO


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_elastic_mesh_never_imports_prime():
    offenders = [p for p in (REPO / "elastic_mesh").rglob("*.py") if "prime" in _imports(p)]
    assert not offenders, f"elastic_mesh must not import prime: {offenders}"


def test_model_code_knows_nothing_of_parallelism():
    imports = _imports(REPO / "prime" / "core" / "model.py")
    text = (REPO / "prime" / "core" / "model.py").read_text()
    assert "elastic_mesh" not in imports and "fully_shard" not in text and "torch.distributed" not in text
