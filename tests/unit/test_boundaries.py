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


def _from_imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, names, line) of every absolute import in the file; `import a.b` gives (a.b, [], line)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names], node.lineno))
    return found


def test_prime_uses_elastic_mesh_only_through_its_public_names():
    import elastic_mesh

    public = set(elastic_mesh.__all__)
    offenders = []
    for path in sorted((REPO / "prime").rglob("*.py")):
        for module, names, line in _from_imports(path):
            if module.split(".")[0] != "elastic_mesh":
                continue
            where = f"{path.relative_to(REPO)}:{line}"
            if module != "elastic_mesh":
                offenders.append(f"{where} imports {module} (a submodule)")
            offenders += [f"{where} imports {name}, not a public name" for name in names if name not in public]
    assert not offenders, "prime reaches into elastic_mesh:\n" + "\n".join(offenders)


def test_every_public_name_of_elastic_mesh_resolves():
    import elastic_mesh

    missing = [name for name in elastic_mesh.__all__ if getattr(elastic_mesh, name, None) is None]
    assert not missing and len(elastic_mesh.__all__) == len(set(elastic_mesh.__all__))


def _package_graph() -> dict[str, set[str]]:
    """unit -> units it imports, a unit being a package's direct child (prime.rl, elastic_mesh.coordinator,
    prime.train): the layers whose arrows must all point one way."""
    def unit(module: str) -> str | None:
        parts = module.split(".")
        return ".".join(parts[:2]) if parts[0] in ("prime", "elastic_mesh") and len(parts) > 1 else None

    graph: dict[str, set[str]] = {}
    for root in ("prime", "elastic_mesh"):
        for path in (REPO / root).rglob("*.py"):
            source = unit(".".join(path.relative_to(REPO).with_suffix("").parts))
            if source is None:
                continue
            targets = {unit(module) for module, _, _ in _from_imports(path)}
            graph.setdefault(source, set()).update(t for t in targets if t and t != source)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_arrow_runs_back_up_between_packages():
    cycle = _cycle(_package_graph())
    assert cycle is None, "these packages import each other (an arrow back up): " + " -> ".join(cycle)


def test_the_cycle_check_sees_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_production_code_never_imports_the_test_package():
    offenders = [f"{p.relative_to(REPO)}:{line}" for p in sorted((REPO / "prime").rglob("*.py"))
                 if "testing" not in p.relative_to(REPO).parts
                 for module, _, line in _from_imports(p) if module.startswith("prime.testing")]
    assert not offenders, "production code imports prime.testing: " + ", ".join(offenders)


def test_model_code_knows_nothing_of_parallelism():
    imports = _imports(REPO / "prime" / "core" / "model.py")
    text = (REPO / "prime" / "core" / "model.py").read_text()
    assert "elastic_mesh" not in imports and "fully_shard" not in text and "torch.distributed" not in text


# Words of the trainer's language. elastic_mesh moves tensors and bytes in numbered rounds and versions
# between members (nodes) that hold leases; an RL trainer or a weight broadcast must be able to use it unbent.
TRAINER_WORDS = {"outer", "inner", "step", "steps", "pseudo", "gradient", "gradients", "grad", "model", "models",
                 "optimizer", "optim", "diloco", "loss", "trainer", "train", "training", "shard", "shards", "rollout",
                 "rollouts", "policy"}


def _words(name: str) -> set[str]:
    import re

    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return {w.lower() for w in spaced.split("_") if w}


def _public_names(path: Path) -> list[tuple[str, int]]:
    """Names a user of the module sees: public classes, functions, methods, their parameters and the
    class-level fields (dataclasses, pydantic models)."""
    found: list[tuple[str, int]] = []

    def visit(body: list, in_class: bool) -> None:
        for item in body:
            if isinstance(item, ast.ClassDef) and not item.name.startswith("_"):
                found.append((item.name, item.lineno))
                visit(item.body, True)
            elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if item.name.startswith("_") and item.name != "__init__":
                    continue
                if item.name != "__init__":
                    found.append((item.name, item.lineno))
                args = item.args
                for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                    if arg.arg not in ("self", "cls") and not arg.arg.startswith("_"):
                        found.append((arg.arg, item.lineno))
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and in_class:
                if not item.target.id.startswith("_"):
                    found.append((item.target.id, item.lineno))
            elif isinstance(item, ast.Assign) and not in_class:
                for target in item.targets:
                    if isinstance(target, ast.Name) and not target.id.startswith("_"):
                        found.append((target.id, item.lineno))

    visit(ast.parse(path.read_text()).body, False)
    return found


def test_elastic_mesh_public_names_carry_no_trainer_vocabulary():
    offenders = [f"{p.relative_to(REPO)}:{line} {name}" for p in sorted((REPO / "elastic_mesh").rglob("*.py"))
                 for name, line in _public_names(p) if _words(name) & TRAINER_WORDS]
    assert not offenders, "elastic_mesh speaks of rounds, members, versions and leases:\n" + "\n".join(offenders)


def test_the_vocabulary_check_sees_a_trainer_word():
    sample = Path(__file__).parent / "_vocabulary_sample.py"
    try:
        sample.write_text("class RoundPlan:\n    outer_step: int\n\ndef commit(round, model_hash): ...\n")
        names = {n for n, _ in _public_names(sample) if _words(n) & TRAINER_WORDS}
    finally:
        sample.unlink()
    assert names == {"outer_step", "model_hash"}
