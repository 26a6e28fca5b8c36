"""The one-device reordering floor: the samples of each training batch permuted, each keeping its noise.

[`WithinBatchPermutation`][vae_ddp.harness.permutation.WithinBatchPermutation] is the callback
the studies' floor runs add (``RunSpec.permute_seed``): the same step, summed in another order.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from pytorch_lightning import Callback, LightningModule, Trainer
from torch import Tensor

__all__ = ["WithinBatchPermutation"]


class WithinBatchPermutation(Callback):
    """One device only: permute the samples of each training batch, each keeping its noise.

    At training batch k (counted from the start of ``fit``) the callback draws
    ``perm = torch.randperm(B)`` from a generator seeded with ``seed * 1_000_003 + k`` and
    reorders, in place, every tensor of the batch whose first dimension is ``B``
    (``x: (B, ...)``, the labels ``(B,)``): row ``i`` becomes row ``perm[i]``. It also wraps
    the LightningModule's ``noise`` attribute (``mu -> eps``, the hook that
    [`VAE`][vae_ddp.model.VAE] and the recipe's module draw their reparameterization noise
    through, and that [`GlobalBatchNoise`][vae_ddp.fixes.noise.GlobalBatchNoise] sets): the
    noise of row ``i`` becomes ``noise(mu)[perm[i]]``, the ``eps`` that sample met in the
    unpermuted run. The loss (a mean over the batch), its gradient and the BatchNorm
    statistics are then the same sums in another order: only floating-point rounding can
    tell the two runs apart.

    Put it after any callback that sets ``noise`` (Lightning calls callbacks in list order).
    Lightning converts the batch to the precision's dtype and moves it to the device before
    ``on_train_batch_start`` (``_TrainingEpochLoop.advance``, Lightning 2.x) and passes that
    same object to ``training_step``, so the in-place reordering reaches the model.

    Args:
        seed: seed of the permutations.

    Raises:
        RuntimeError: used with more than one process, or on a module without ``noise``.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._batch = 0
        self._perm: Optional[Tensor] = None
        self._inner: Optional[Callable[[Tensor], Tensor]] = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._batch = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.world_size != 1:
            raise RuntimeError(f"WithinBatchPermutation is a one-device probe; this run has world size "
                               f"{trainer.world_size}")
        if not callable(getattr(pl_module, "noise", None)):
            raise RuntimeError(f"{type(pl_module).__name__} has no `noise(mu)` to draw its noise through; "
                               "without it the noise could not follow its sample")
        n = len(batch[0])
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self._batch)
        self._perm = torch.randperm(n, generator=g)
        for t in batch:
            if isinstance(t, Tensor) and t.dim() > 0 and len(t) == n:
                t.copy_(t[self._perm.to(t.device)])
        self._inner = pl_module.noise
        pl_module.noise = self

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if pl_module.__dict__.get("noise") is self:  # not already restored by a callback before this one
            if getattr(self._inner, "__self__", None) is pl_module:
                del pl_module.noise  # it was the module's own method
            else:
                pl_module.noise = self._inner
        self._batch += 1

    def __call__(self, mu: Tensor) -> Tensor:
        """``eps`` for the permuted rows: the unpermuted ``noise(mu)[perm]``, ``mu: (B, latent_dim)``."""
        eps = self._inner(mu)
        return eps[self._perm.to(eps.device)]
