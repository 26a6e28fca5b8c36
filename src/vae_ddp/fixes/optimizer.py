"""The optimizer factor: Adam's per-parameter step sizes under the shared noise of DDP.

It has no fix of its own. Adam divides each step by the square root of its running second
moment of the gradient (Kingma and Ba, 2015); when every rank draws the same noise, the
all-reduced gradient has a larger variance than one device's (the ranks' noise does not
average out), so the second moments and the step sizes differ from one device's. Fixing the
noise ([`vae_ddp.fixes.noise`][vae_ddp.fixes.noise]) removes it; ``DDPAudit`` reports it
with the noise finding.
"""

from __future__ import annotations

from typing import Optional

from vae_ddp.fixes import noise
from vae_ddp.fixes.factor import Audit, Factor

__all__ = ["FACTOR"]


def _check(trainer, module, datamodule) -> Optional[str]:
    if noise.FACTOR.check(trainer, module, datamodule):
        return "Adam's second moment absorbs the extra gradient variance of the shared noise: fix the noise"
    return None


FACTOR = Factor(
    position=6, key="optimizer", name="Optimizer (Adam)", page="factors/optimizer.md",
    changes="none of its own: fixing the noise removes it", check=_check, fixed_by="noise",
    audit=Audit(mechanism="follows", clean="follows the noise check"))
