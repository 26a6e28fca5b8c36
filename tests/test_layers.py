"""The import graph of src/: the fixes below the harness, the harness below the studies and the
audit. Read from the source (every import statement, lazy ones inside functions included)."""

import ast
from pathlib import Path
from helpers import ROOT

SRC = ROOT / "src" / "vae_ddp"


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def _importing(package: str, above: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for path in sorted((SRC / package).rglob("*.py")):
        bad = sorted(m for m in _imports(path) if m.startswith(above))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_the_harness_imports_no_study_and_no_audit():
    assert _importing("harness", ("vae_ddp.studies", "vae_ddp.audit", "vae_ddp.cli")) == {}


def test_the_fixes_import_no_harness_study_or_audit():
    assert _importing("fixes", ("vae_ddp.harness", "vae_ddp.studies", "vae_ddp.audit", "vae_ddp.cli")) == {}


def test_the_graph_is_read():
    """The reader sees imports of every form (the checks above cannot pass by reading nothing)."""
    assert "vae_ddp.harness.configs.RunSpec" in _imports(SRC / "studies" / "equivalence.py")
    assert "vae_ddp.harness.permutation.WithinBatchPermutation" in _imports(SRC / "harness" / "runner.py")  # lazy


def _module_graph() -> dict[str, set[str]]:
    """``{module: the modules of src/ it imports}``; ``from pkg import mod`` is the module ``pkg.mod``."""
    mods = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("")
        mods[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = path
    graph = {}
    for name, path in mods.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                          for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {m for m in found if m in mods and m != name}
    return graph


def test_no_import_circle():
    """No module of src/ imports itself back through others (lazy imports inside functions count)."""
    from graphlib import CycleError, TopologicalSorter

    graph = _module_graph()
    assert len(graph) > 40 and sum(map(len, graph.values())) > 100  # the graph is read
    try:
        list(TopologicalSorter(graph).static_order())
    except CycleError as err:
        raise AssertionError(f"an import circle: {' -> '.join(err.args[1])}") from None
    graph["vae_ddp.fixes.factor"] = graph["vae_ddp.fixes.factor"] | {"vae_ddp.fixes.registry"}  # one made up
    try:
        list(TopologicalSorter(graph).static_order())
    except CycleError:
        return
    raise AssertionError("a made-up circle was not found")
