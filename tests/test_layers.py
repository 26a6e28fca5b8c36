"""The import graph of src/: the fixes below the harness, the harness below the studies and the
audit; the audit and the fixes below nothing of the VAE study. Read from the source (every import
statement, lazy ones inside functions included), and measured in the processes that import them."""

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
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
    """``{module: the modules of src/ it imports}``; ``from pkg import mod`` is the module ``pkg.mod``,
    and ``from vae_ddp import NAME`` the module that ``vae_ddp._EXPORTS`` imports for ``NAME``."""
    mods = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("")
        mods[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = path
    exports = _exports()
    graph = {}
    for name, path in mods.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                          for a in node.names}
                if node.module == "vae_ddp":
                    found |= {exports[a.name] for a in node.names if a.name in exports}
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


def _exports() -> dict[str, str]:
    """``vae_ddp._EXPORTS`` read from the source: ``{name: module}`` of the package's lazy names."""
    tree = ast.parse((SRC / "__init__.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "_EXPORTS")
    return ast.literal_eval(node.value)


#: The VAE study: the model, its data, Lightning 1.x DP, the studies (and the CLI of the studies).
STUDY = ("vae_ddp.model", "vae_ddp.data", "vae_ddp.dp", "vae_ddp.studies", "vae_ddp.cli")


def _study(module: str) -> bool:
    return any(module == s or module.startswith(s + ".") for s in STUDY)


def _reached(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """``{module: the chain of imports from start to it}`` for every module ``start`` imports, at
    once or through others; importing ``a.b.c`` also imports the packages ``a`` and ``a.b``."""
    chains, todo = {start: [start]}, [start]
    while todo:
        module = todo.pop()
        parents = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
        for nxt in sorted((graph.get(module, set()) | parents) & set(graph)):
            if nxt not in chains:
                chains[nxt] = chains[module] + [nxt]
                todo.append(nxt)
    return chains


def _audit_and_fixes(graph: dict[str, set[str]]) -> list[str]:
    return sorted(m for m in graph if m.startswith(("vae_ddp.audit", "vae_ddp.fixes")))


def test_the_audit_and_the_fixes_reach_no_study_code():
    """No module of the audit or the fixes imports the VAE study (model, data, dp, studies, cli),
    through any chain of imports, lazy ones included: the audit of a user's module is the user's
    module, Lightning and this package's audit, fixes and harness."""
    graph = _module_graph()
    leaks = {m: " -> ".join(chain) for m in _audit_and_fixes(graph)
             for reached, chain in _reached(graph, m).items() if _study(reached)}
    assert leaks == {}


def test_the_reach_is_read():
    """The walk finds a chain through lazy imports and the package's lazy names (the test above
    cannot pass by reading nothing)."""
    graph = _module_graph()
    assert len(_audit_and_fixes(graph)) > 20
    assert _reached(graph, "vae_ddp.studies.equivalence")["vae_ddp.model"][0] == "vae_ddp.studies.equivalence"
    made_up = {"a": {"vae_ddp"}, "vae_ddp": set(), "vae_ddp.x": {"vae_ddp.model"}, "vae_ddp.model": set()}
    assert "vae_ddp.model" not in _reached(made_up, "a")
    assert _reached(made_up, "vae_ddp.x")["vae_ddp.model"] == ["vae_ddp.x", "vae_ddp.model"]
    assert _exports()["VAE"] == "vae_ddp.model"


def _loaded_after(code: str) -> list[str]:
    """The modules of ``vae_ddp`` a fresh interpreter holds after running ``code``."""
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith('vae_ddp'))))\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.timeout(300)
def test_importing_the_audit_and_the_fixes_loads_no_study_code():
    """Measured: a fresh interpreter that imports every module of the audit and the fixes (the
    audit's rank entry ``vae_ddp.audit.run`` among them) and reads the factor registry (which
    imports the fixes by name) holds none of the VAE study's modules."""
    loaded = _loaded_after(textwrap.dedent("""
        import importlib, pkgutil
        import vae_ddp.audit, vae_ddp.fixes
        for package in (vae_ddp.audit, vae_ddp.fixes):
            for m in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
                importlib.import_module(m.name)
        from vae_ddp.fixes import registry
        registry.factors()
    """))
    assert "vae_ddp.audit.run" in loaded and "vae_ddp.fixes.registry" in loaded  # the probe ran
    assert [m for m in loaded if _study(m)] == []


PROBE = """
import json, os, sys

from examples.audit_models import Plain as _Plain


class Plain(_Plain):
    \"\"\"The audit's small model; each training step appends its process's modules of vae_ddp.\"\"\"

    def training_step(self, batch, batch_idx):
        with open(os.environ["VAE_DDP_TEST_MODULES"], "a") as f:
            f.write(json.dumps([os.getpid(), sorted(m for m in sys.modules if m.startswith("vae_ddp"))]) + "\\n")
        return super().training_step(batch, batch_idx)
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_audits_processes_load_no_study_code(tmp_path):
    """Measured in a real ``vae-ddp audit`` (2 steps): every process that trains a step of the user's
    model (the one-process check, the one-device runs and both DDP ranks) records its modules;
    none holds the VAE study's. (Measured when written: the DDP ranks and the one-device runs held
    32 modules of vae_ddp, all of the audit, the fixes, the harness's launch and the utilities.)
    ``slow``: a whole audit, tens of seconds; the two tests above guard the same in every run."""
    (tmp_path / "probe_models.py").write_text(PROBE)
    record = tmp_path / "modules.jsonl"
    env = dict(os.environ, VAE_DDP_TEST_MODULES=str(record),
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    done = subprocess.run([sys.executable, "-m", "vae_ddp.audit.cli", "--model", f"{tmp_path}/probe_models.py:Plain",
                           "--data", "examples.audit_models.Regression", "--steps", "2",
                           "--out", str(tmp_path / "audit")],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=590)
    assert (tmp_path / "audit" / "audit.json").exists(), done.stderr[-3000:]
    seen = [json.loads(line) for line in record.read_text().splitlines()]
    pids = {pid for pid, _ in seen}
    assert len(pids) >= 3, pids  # the DDP ranks and at least one process beside them trained
    assert {m for _, modules in seen for m in modules if _study(m)} == set()


#: What runs as ``__main__`` in src/ and tools/: the commands a user types, and the two processes
#: the project starts itself: the guard (which is also a zygote: ``--zygote``) and a launch's child.
COMMANDS = {"src/vae_ddp/cli.py", "src/vae_ddp/audit/cli.py", "tools/results.py",
            "tools/site_address.py"}  # the Pages workflow's step that writes the site's address
CHILDREN = {"src/vae_ddp/guard.py", "src/vae_ddp/harness/__main__.py"}


def test_the_project_starts_two_entry_points_besides_its_commands():
    """The only modules of the project that run as ``__main__`` besides its commands are the guard
    (``python -m vae_ddp.guard``: a guard or a zygote) and a launch's child (``python -m
    vae_ddp.harness``): the docs' entries run in a zygote's forks, the long-horizon pool in
    ``multiprocessing``'s own workers (``forking.spawned_map``)."""
    def runs_as_main(path: Path) -> bool:
        return path.name == "__main__.py" or any(
            isinstance(n, ast.If) and ast.unparse(n.test).startswith("__name__ == '__main__'")
            for n in ast.parse(path.read_text()).body)

    mains = {str(p.relative_to(ROOT)) for d in (SRC, ROOT / "tools") for p in d.rglob("*.py") if runs_as_main(p)}
    assert mains == COMMANDS | CHILDREN, mains


def test_no_module_holds_more_than_500_lines():
    """A module a newcomer reads in one sitting: no file of src/ or tools/ over 500 lines."""
    long = {str(p.relative_to(ROOT)): n for d in (SRC, ROOT / "tools") for p in d.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long
