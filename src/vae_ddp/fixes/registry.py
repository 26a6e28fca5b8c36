"""The factors, found in their fix modules and kept in the order of the docs.

Each fix module, named by its factor's key, declares its [`Factor`][vae_ddp.fixes.factor.Factor]
as ``FACTOR`` beside the fix (name, page, place in the docs' order, what the fix adds, the
exposure check, what ``DDPAudit`` watches); this module only finds them: every module of
``vae_ddp.fixes`` that declares a ``FACTOR`` (today ``noise``, ``batchnorm``, ``sampler``,
``reduction``, ``logging``, ``optimizer``). No list of factors is written anywhere else.

Every place that enumerates the fixes reads this registry instead of listing them:
``RunSpec.exact()`` and ``RunSpec.fixes()`` ([`RunSpec`][vae_ddp.harness.configs.RunSpec]), the
``Trainer`` of a run (``vae_ddp.harness.runner.build_trainer``), the ablation's and the
step-time benchmark's variants, the ``vae-ddp`` switches, and the runs of `vae-ddp audit`
(its fixes and its ablation: [`audit_parts`][vae_ddp.fixes.registry.audit_parts],
[`audit_fixable`][vae_ddp.fixes.registry.audit_fixable]). Adding a factor is one fix
module declaring its ``FACTOR``, one example and one page (plus, if it has a ``RunSpec`` switch,
that field with its ``Literal``/``bool`` type: the field is the typed flag); code that is not
a fix module (a test) passes its [`Factor`][vae_ddp.fixes.factor.Factor] to
[`register`][vae_ddp.fixes.factor.register].
[`exposures`][vae_ddp.fixes.registry.exposures]``(trainer, model, datamodule)`` runs every
factor's exposure check and returns ``{factor key: evidence}`` for the factors a run is exposed to.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from types import ModuleType
from typing import Any

from vae_ddp.fixes.factor import HOOKS, Factor, Finding, FixParts, Seen, factors, get, register, unregister

__all__ = ["Factor", "FixParts", "Finding", "Seen", "HOOKS", "factors", "get", "register", "unregister", "exposures",
           "switches", "audit_fixable", "audit_parts", "watchers", "fix_modules", "MODULES"]


def fix_modules() -> tuple[str, ...]:
    """The names of the fix modules: every public module of ``vae_ddp.fixes`` but the factor
    store (``factor``, this ``registry``), by name."""
    return tuple(f"vae_ddp.fixes.{info.name}" for info in pkgutil.iter_modules([str(Path(__file__).parent)])
                 if not info.name.startswith("_") and info.name not in ("factor", "registry"))


def _factor_modules() -> tuple[ModuleType, ...]:
    """Every fix module that declares a ``FACTOR``, in the order of the docs."""
    found = [m for m in map(importlib.import_module, fix_modules()) if isinstance(getattr(m, "FACTOR", None), Factor)]
    return tuple(sorted(found, key=lambda m: m.FACTOR.position))


#: the fix modules that declare the factors, in the order of the docs
MODULES = _factor_modules()
for _module in MODULES:
    register(_module.FACTOR)


def audit_fixable() -> tuple[str, ...]:
    """The keys of the factors `vae-ddp audit` fixes by itself (those with ``audit_parts``), in order."""
    return tuple(f.key for f in factors() if f.audit_parts is not None)


def audit_parts(run: Any) -> FixParts:
    """What the audit adds to ``run`` (an ``AuditRun``) for the fixes in ``run.fixes``."""
    parts = FixParts()
    for f in factors():
        if f.key in run.fixes and f.audit_parts is not None:
            parts = parts.merge(f.audit_parts(run))
    return parts


def switches() -> tuple[Factor, ...]:
    """The factors that have a ``RunSpec`` switch."""
    return tuple(f for f in factors() if f.field is not None)


def watchers(hook: str) -> list[tuple[str, Any]]:
    """``[(factor key, watch)]`` of the factors that watch ``hook`` (one of
    ``vae_ddp.fixes.factor.HOOKS``), in registry order.

    Raises:
        ValueError: ``hook`` is not one of ``HOOKS``.
    """
    if hook not in HOOKS:
        raise ValueError(f"unknown hook {hook!r}: one of {HOOKS}")
    return [(f.key, f.watch[hook]) for f in factors() if hook in f.watch]


def exposures(trainer: Any, module: Any, datamodule: Any = None) -> dict[str, str]:
    """Which factors a run is exposed to: ``{factor key: why}`` for each exposed one.

    Args:
        trainer: a ``pytorch_lightning.Trainer`` (its world size, callbacks, plugins).
        module: the ``LightningModule`` (its BatchNorm layers; ``sync_dist_logging`` if it has one,
            else logging is reported as exposed).
        datamodule: the ``LightningDataModule`` (its ``sampler``, ``batch_size`` and training set);
            may be set up (``setup("fit")``) to count the training samples.
    """
    out = {}
    for f in factors():
        why = f.check(trainer, module, datamodule)
        if why:
            out[f.key] = why
    return out
