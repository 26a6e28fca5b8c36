"""Checks of the audit made in one process, before any training, on the first global batches.

Each factor declares its own (``before`` of its [`Factor`][vae_ddp.fixes.factor.Factor]);
[`static_findings`][vae_ddp.audit.static.static_findings] runs them in registry order:

- Random streams per rank ([`vae_ddp.fixes.noise`][vae_ddp.fixes.noise]): does the dataset
  return different values for the same index on two reads? Random augmentation in
  ``__getitem__`` is drawn in the DataLoader workers from seeds that derive from the same base
  seed on every rank, and per sample differently for every world size. And does the loader's
  ``collate_fn`` return different batches for the same samples? A batch-level draw there
  (mixup's lambda and pairing) is made from the same seed on every rank, over B/N samples
  instead of B.
- Mean reduction ([`vae_ddp.fixes.reduction`][vae_ddp.fixes.reduction]): is the loss a mean
  over samples? With the same weights, the gradient of the global batch must equal the mean of
  the gradients of its N per-rank chunks (what DDP's gradient all-reduce averages). A loss
  averaged over a variable number of items per rank (tokens with ``ignore_index``, valid
  pixels, boxes) breaks it. Measured in eval mode (BatchNorm with running statistics, no
  dropout) so only the reduction differs; without a process group, so the audit asks again
  under the real one when it flags a loss.
"""

from __future__ import annotations

from typing import Any

from vae_ddp.fixes import registry
from vae_ddp.fixes.factor import CannotTell, Finding

__all__ = ["static_findings"]


def static_findings(model: Any, dm: Any, batches: list, n: int) -> tuple[list[Finding], list[str]]:
    """The [`Finding`][vae_ddp.fixes.factor.Finding]s of every factor's one-process check, and the
    notes of the checks that could not tell ([`CannotTell`][vae_ddp.fixes.factor.CannotTell]: the
    loss reduction of a step that draws from torch's seed).

    Args:
        model: the user's ``LightningModule``; dm: its ``LightningDataModule`` (set up).
        batches: a few global batches of the training loader.
        n: the DDP world size the batches are split for.
    """
    found, notes = [], []
    for factor in registry.factors():
        try:
            found += factor.before(model, dm, batches, n) if factor.before is not None else []
        except CannotTell as why:
            notes.append(str(why))
    return found, notes
