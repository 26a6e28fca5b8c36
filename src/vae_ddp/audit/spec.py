"""What one audit run trains: the user's classes, the world size and the fixes that are on.

A class is given as ``{"class_path": "pkg.mod.Class", "init_args": {...}}`` (the form
jsonargparse and LightningCLI use) plus, for ``path/to/file.py:Class``, the file to import
first (:func:`import_class` registers it under a module name of its own, in every process).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

__all__ = ["AuditRun", "import_class", "resolve_class_arg", "FIXABLE"]

FIXABLE = ("noise", "batchnorm", "sampler")
"""Factors the audit can switch on for any LightningModule, in the order it applies them."""


def _module_name(path: Path) -> str:
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
    return f"_vae_ddp_user_{path.stem}_{digest}"


def resolve_class_arg(value: str) -> tuple[str, Optional[str]]:
    """``path/to/file.py:Class`` -> (``module.Class`` importable in this process, file); a
    dotted path is returned as it is.

    Raises:
        ValueError: the file does not exist.
    """
    if ".py:" not in value:
        return value, None
    file, _, name = value.rpartition(":")
    path = Path(file)
    if not path.is_file():
        raise ValueError(f"{file} does not exist: give path/to/file.py:Class or package.module.Class")
    mod = _import_file(path)
    return f"{mod.__name__}.{name}", str(path.resolve())


def _import_file(path: Path):
    name = _module_name(path)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def import_class(class_path: str, file: Optional[str] = None) -> type:
    """The class named ``class_path``, importing ``file`` first when the class lives in a file."""
    if file:
        _import_file(Path(file))
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@dataclass
class AuditRun:
    """One training run of the audit (JSON-serialisable; the child process re-reads it).

    Attributes:
        model, data: ``{"class_path", "init_args"}`` of the LightningModule and DataModule.
        model_file, data_file: the ``.py`` file to import first, or None.
        devices: the world size of this run (1: one device).
        global_batch_size: samples per optimizer step over all ranks (B); each rank's
            DataModule gets ``batch_size = B // devices``.
        steps: optimizer steps. dtype: ``float64`` or ``float32``. accelerator: ``cpu``/``gpu``.
        seed: ``seed_everything(seed)`` before the model is built (same initial weights).
        fixes: names of `FIXABLE` factors whose fix is on.
        permute: permute the samples inside each batch (and the noise rows with them): the
            one-device reordering floor.
        label: the run's name in the report.
    """

    model: dict
    data: dict
    model_file: Optional[str] = None
    data_file: Optional[str] = None
    devices: int = 1
    global_batch_size: int = 32
    steps: int = 4
    dtype: str = "float64"
    accelerator: str = "cpu"
    seed: int = 0
    fixes: list[str] = field(default_factory=list)
    permute: bool = False
    label: str = ""

    @property
    def world_size(self) -> int:
        return self.devices

    def replace(self, **kw: Any) -> "AuditRun":
        return dataclasses.replace(self, **kw)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "AuditRun":
        return cls(**json.loads(text))
