"""What the tests share: the repository's root and a script of it loaded as a module."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Optional

import pytest

#: The repository's root (the folder of pyproject.toml).
ROOT = Path(__file__).resolve().parents[1]


def load_script(path: "str | Path", name: Optional[str] = None,
                monkeypatch: Optional[pytest.MonkeyPatch] = None) -> ModuleType:
    """``ROOT / path`` (a script of ``examples/``, ``benchmarks/`` or ``tools/``) executed as a
    module named ``name`` (default: its file name), which ``sys.modules`` does not keep.

    ``monkeypatch``: the script's folder first on ``sys.path`` for the test
    (``monkeypatch.syspath_prepend``), for a script that imports its neighbours (``recipe_check``
    imports ``recipe``); pytest takes it off again after the test.

    Raises:
        FileNotFoundError: no such script.
    """
    file = ROOT / path
    if monkeypatch is not None:
        monkeypatch.syspath_prepend(str(file.parent))
    spec = importlib.util.spec_from_file_location(name or file.stem, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def imported_modules(path: "str | Path", lazy: bool = True) -> list[str]:
    """Every module ``ROOT / path`` imports: anywhere in the file (lazy imports in functions included), or
    with ``lazy=False`` at its top level only. ``import a.b`` and ``from a.b import c`` give ``a.b``; what a
    ground-truth script must not name is ``vae_ddp``."""
    import ast

    tree = ast.parse((ROOT / path).read_text())
    names = []
    for node in (ast.walk(tree) if lazy else tree.body):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module or "")
    return names


def same_measurement(new: object, old: object) -> bool:
    """A truth script's JSON measured again (``new``) against the committed one (``old``): the same keys,
    lengths and strings, floats within 1e-6 relative (1e-15 absolute)."""
    import math

    if isinstance(new, dict):
        return isinstance(old, dict) and new.keys() == old.keys() and all(same_measurement(new[k], old[k]) for k in new)
    if isinstance(new, list):
        return isinstance(old, list) and len(new) == len(old) and all(map(same_measurement, new, old))
    if isinstance(new, float) and isinstance(old, (int, float)):
        return math.isclose(new, old, rel_tol=1e-6, abs_tol=1e-15)
    return new == old
