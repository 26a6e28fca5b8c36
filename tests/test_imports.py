"""Every module of the package imports, and the fixes import each other one way only: no two
modules of ``vae_ddp.fixes`` import each other, at module level or inside a function."""

import ast
import importlib
from pathlib import Path

import pytest
from helpers import ROOT

SRC = ROOT / "src"
FIXES = SRC / "vae_ddp" / "fixes"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> list[str]:
    return sorted(_module_name(p) for p in (SRC / "vae_ddp").rglob("*.py"))


@pytest.mark.parametrize("name", _modules())
def test_every_module_imports(name):
    importlib.import_module(name)


def imports_of(source: str, package: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``source`` (a module of ``package``) imports anywhere:
    ``import a.b``, ``from a.b import c`` and ``from a import b`` (``a.b`` when it is a module),
    relative imports resolved against ``package``; the package itself is left out."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle of ``graph`` (``{module: modules it imports}``), each from its smallest name."""
    found = set()

    def walk(start, node, path):
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                found.add(tuple(path))
            elif nxt > start and nxt not in path:
                walk(start, nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return [list(c) for c in sorted(found)]


def fixes_graph() -> dict[str, set[str]]:
    modules = {f"vae_ddp.fixes.{p.stem}" for p in FIXES.glob("*.py") if p.stem != "__init__"}
    return {m: imports_of((FIXES / f"{m.rsplit('.', 1)[1]}.py").read_text(), "vae_ddp.fixes", modules) - {m}
            for m in modules}


def test_the_checker_finds_a_circle():
    modules = {"p.a", "p.b", "p.c"}
    graph = {"p.a": imports_of("from p.b import x\n", "p", modules),
             "p.b": imports_of("def f():\n    from . import c\n", "p", modules),
             "p.c": imports_of("import p.a\n", "p", modules)}
    assert graph == {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}}
    assert cycles(graph) == [["p.a", "p.b", "p.c"]]
    assert cycles({"p.a": {"p.b"}, "p.b": set()}) == []


def test_no_two_fixes_import_each_other():
    graph = fixes_graph()
    assert "vae_ddp.fixes.dropout" in graph["vae_ddp.fixes.randomness"]  # the callback swaps dropout layers
    assert cycles(graph) == [], f"import circles among vae_ddp.fixes modules: {cycles(graph)}"


RE_CALLS = {"compile", "sub", "subn", "match", "fullmatch", "search", "split", "findall", "finditer"}


def literal_patterns(source: str) -> list[tuple[int, str]]:
    """``(line, pattern)`` of every ``re.NAME("literal", ...)`` call of ``source`` (``NAME``: ``RE_CALLS``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in RE_CALLS
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "re" and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def test_every_regular_expression_compiles_without_a_warning():
    """``re.sub(r'^[[]rank...', ...)`` in harness/launch.py printed ``FutureWarning: Possible nested set at
    position 2`` when it first ran, in front of the DataLoader worker's error it was cleaning up. Every literal
    pattern of the package compiles with warnings as errors (``re``'s cache emptied first: a cached pattern
    warns no more)."""
    import re
    import warnings

    checked, bad = 0, []
    for path in sorted((SRC / "vae_ddp").rglob("*.py")):
        for line, pattern in literal_patterns(path.read_text()):
            checked += 1
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                try:
                    re.purge()
                    re.compile(pattern)
                except (Warning, re.error) as err:
                    bad.append(f"{path.relative_to(SRC)}:{line}: {pattern!r}: {err}")
    assert checked > 10 and not bad, bad
