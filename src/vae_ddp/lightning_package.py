"""Which of Lightning's two packages a process of the audit uses: ``pytorch_lightning`` or ``lightning.pytorch``.

Lightning ships one code base as two packages at one version, ``pytorch_lightning`` (with ``lightning_fabric``)
and ``lightning`` (``lightning.pytorch``, ``lightning.fabric``), whose classes are distinct: a ``Trainer`` of one
refuses the other's modules, callbacks and plugins (Lightning 2.x). This package is written against
``pytorch_lightning``. A process whose environment has ``VAE_DDP_LIGHTNING=lightning`` (set for the audit's runs
of a module built on ``lightning.pytorch``, [`env_for`][vae_ddp.lightning_package.env_for]) sees
``lightning.pytorch`` and ``lightning.fabric`` under the names ``pytorch_lightning`` and ``lightning_fabric``, every
submodule included, once ``vae_ddp`` is imported (before anything imports either name): the Trainer, the
callbacks, strategies and plugins of the audit are then the user's package's own, one module object per module
(``import pytorch_lightning.strategies`` is ``lightning.pytorch.strategies``, never a second copy).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
from typing import Any, Optional

__all__ = ["ENV", "ALIASES", "of", "is_a", "one_package", "env_for", "install"]

#: The environment variable that names the package of a process (``lightning``; unset: ``pytorch_lightning``).
ENV = "VAE_DDP_LIGHTNING"

#: Each name this package imports -> the module of ``lightning`` it stands for under ``VAE_DDP_LIGHTNING=lightning``.
ALIASES = {"pytorch_lightning": "lightning.pytorch", "lightning_fabric": "lightning.fabric"}


def of(*classes: type) -> str:
    """``"lightning"`` when a class of ``classes`` is built on ``lightning.pytorch`` (a base class of its MRO comes
    from a module under ``lightning.``), else ``"pytorch_lightning"``."""
    return "lightning" if any(k.__module__.startswith("lightning.") for c in classes
                              for k in getattr(c, "__mro__", ())) else "pytorch_lightning"


def is_a(cls: Any, base: str) -> bool:
    """Whether ``cls`` is a class with ``base`` (``"pytorch_lightning.core.module.LightningModule"``, a module and
    a qualified name) in its MRO, from either package (``lightning.pytorch.core.module.LightningModule`` too)."""
    names = {base, base.replace("pytorch_lightning.", "lightning.pytorch.", 1)}
    return isinstance(cls, type) and any(f"{k.__module__}.{k.__qualname__}" in names for k in cls.__mro__)


def one_package(model_cls: type, data_cls: type) -> str:
    """The package (``of``) both the user's module and datamodule classes are built on.

    Raises:
        vae_ddp.errors.UserError: one is built on ``lightning.pytorch``, the other on ``pytorch_lightning``."""
    from vae_ddp.errors import UserError

    names = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}
    model, data = of(model_cls), of(data_cls)
    if model != data:
        raise UserError(f"--model {model_cls.__name__} is built on {names[model]} and --data {data_cls.__name__} on "
                        f"{names[data]}: a Trainer takes one package's classes; build both on one of them")
    return model


def env_for(package: str) -> dict[str, str]:
    """The environment entries of a process that runs a module of ``package`` (``of``'s answer)."""
    return {ENV: "lightning"} if package == "lightning" else {}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``pytorch_lightning[.X]`` (``lightning_fabric[.X]``) as the module ``lightning.pytorch[.X]``
    (``lightning.fabric[.X]``): the loader hands back the imported module itself, its ``__spec__`` kept."""

    def __init__(self) -> None:
        self._specs: dict[str, Any] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Optional[Any]:
        top, dot, rest = fullname.partition(".")
        if top not in ALIASES:
            return None
        real = ALIASES[top] + dot + rest
        if importlib.util.find_spec(real) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        top, dot, rest = spec.name.partition(".")
        module = importlib.import_module(ALIASES[top] + dot + rest)
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = self._specs.pop(module.__spec__.name, module.__spec__)  # the real module's own again


def install() -> bool:
    """Alias the names (``ALIASES``) in this process where ``VAE_DDP_LIGHTNING=lightning``; True when they are.

    Raises:
        RuntimeError: ``pytorch_lightning`` was imported before (its classes would be mixed with lightning's).
    """
    if os.environ.get(ENV) != "lightning":
        return False
    if any(isinstance(f, _Alias) for f in sys.meta_path):
        return True
    if "pytorch_lightning" in sys.modules and sys.modules["pytorch_lightning"].__name__ != "lightning.pytorch":
        raise RuntimeError(f"{ENV}=lightning, but pytorch_lightning was imported first")
    sys.meta_path.insert(0, _Alias())
    return True
