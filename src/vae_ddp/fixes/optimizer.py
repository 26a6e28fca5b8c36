"""The optimizer factor: an adaptive optimizer's per-parameter step sizes under the shared noise of DDP.

It has no fix of its own, and only an optimizer that scales each parameter's step by a running
statistic of its gradient (Adam and its kin, RMSprop, Adagrad, Adadelta: ``ADAPTIVE``) is exposed;
SGD, with or without momentum, steps along the all-reduced gradient itself. Adam divides each step by the square root of its running second
moment of the gradient (Kingma and Ba, 2015); when every rank draws the same noise, the
all-reduced gradient has a larger variance than one device's (the ranks' noise does not
average out), so the second moments and the step sizes differ from one device's. Fixing the
noise ([`vae_ddp.fixes.noise`][vae_ddp.fixes.noise]) removes it; ``DDPAudit`` reports it
with the noise finding.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from vae_ddp.fixes import noise
from vae_ddp.fixes.factor import Audit, Factor

__all__ = ["ADAPTIVE", "ADAPTIVE_STATE", "adaptive", "FACTOR"]

#: torch's optimizers that scale each parameter's step by a running statistic of its gradient.
ADAPTIVE = tuple(getattr(torch.optim, name) for name in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad",
                                                         "Adadelta", "RMSprop", "SparseAdam")
                 if hasattr(torch.optim, name))

#: the per-parameter state of those statistics in torch's optimizers (a third-party optimizer that
#: keeps one under these names is counted too, once it has stepped)
ADAPTIVE_STATE = ("exp_avg_sq", "square_avg", "exp_inf", "acc_delta", "sum")


def adaptive(optimizers: Iterable[Any]) -> list[str]:
    """The class names of the ``optimizers`` with per-parameter step sizes: one of ``ADAPTIVE``, or
    one whose state holds a statistic of ``ADAPTIVE_STATE``; an empty list for SGD."""
    out = []
    for opt in optimizers:
        opt = getattr(opt, "optimizer", opt)  # a LightningOptimizer wraps the user's
        state = getattr(opt, "state", {}) or {}
        if isinstance(opt, ADAPTIVE) or any(k in s for s in state.values() if isinstance(s, dict) for k in ADAPTIVE_STATE):
            out.append(type(opt).__name__)
    return list(dict.fromkeys(out))


def _check(trainer, module, datamodule) -> Optional[str]:
    optimizers = list(getattr(trainer, "optimizers", None) or [])
    names = adaptive(optimizers)
    if optimizers and not names:
        return None  # SGD: no per-parameter step sizes to change
    if noise.FACTOR.check(trainer, module, datamodule):
        what = ", ".join(names) if names else "an adaptive optimizer (Adam, RMSprop, Adagrad)"
        return f"{what}'s per-parameter step sizes absorb the extra gradient variance of the shared noise: fix the noise"
    return None


FACTOR = Factor(
    position=6, key="optimizer", name="Optimizer", page="factors/optimizer.md",
    changes="none of its own: fixing the noise removes it", check=_check, fixed_by="noise",
    audit=Audit(mechanism="follows",
                clean="no adaptive optimizer (Adam, RMSprop, Adagrad, ...) under noise shared across ranks"))
