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
