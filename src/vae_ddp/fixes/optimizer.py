"""The optimizer factor: an adaptive optimizer's per-parameter step sizes under the shared noise of DDP.

It has no fix of its own, and only an optimizer that scales each parameter's step by a running
statistic of its gradient (Adam and its kin, RMSprop, Adagrad, Adadelta: ``ADAPTIVE``) is exposed;
SGD, with or without momentum, steps along the all-reduced gradient itself. Adam divides each step by
the square root of its running second moment of the gradient (Kingma and Ba, 2015); when every
rank draws the same noise, the all-reduced gradient has a larger variance than one device's (the ranks' noise does not
average out), so the second moments and the step sizes differ from one device's. Fixing the
noise ([`vae_ddp.fixes.noise`][vae_ddp.fixes.noise]) removes it; ``DDPAudit`` reports it
with the noise finding.
"""

from __future__ import annotations

from typing import Optional

from vae_ddp.fixes import noise
from vae_ddp.fixes.factor import Audit, Factor
# declared beside the noise check, which names them (a module of each would import the other)
from vae_ddp.fixes.noise import ADAPTIVE, ADAPTIVE_STATE, adaptive

__all__ = ["ADAPTIVE", "ADAPTIVE_STATE", "adaptive", "FACTOR"]

def _check(trainer, module, datamodule) -> Optional[str]:
    optimizers = list(getattr(trainer, "optimizers", None) or [])
    names = adaptive(optimizers)
    if optimizers and not names:
        return None  # SGD: no per-parameter step sizes to change
    if noise.FACTOR.check(trainer, module, datamodule):
        what = ", ".join(names) if names else "an adaptive optimizer (Adam, RMSprop, Adagrad)"
        return (f"{what}'s per-parameter step sizes absorb the extra gradient variance of the shared noise: "
                "fix the noise")
    return None


FACTOR = Factor(
    position=6, key="optimizer", name="Optimizer", page="factors/optimizer.md",
    changes="none of its own: fixing the noise removes it", check=_check, fixed_by="noise",
    audit=Audit(mechanism="follows",
                clean="no adaptive optimizer (Adam, RMSprop, Adagrad, ...) under noise shared across ranks"))
