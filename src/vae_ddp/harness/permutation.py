"""The one-device reordering floor: the samples of each training batch permuted, each keeping its random draws.

[`WithinBatchPermutation`][vae_ddp.harness.permutation.WithinBatchPermutation] is the one callback
the floor runs add: the studies' (``RunSpec.permute_seed``), the recipe's check and the audit's;
``FLOOR_FACTOR`` is how many times the floor's largest draw a DDP step may differ from one
device's and still match it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from pytorch_lightning import Callback, LightningModule, Trainer
from torch import Tensor, nn

from vae_ddp.fixes.factor import batch_tensors
from vae_ddp.fixes.randomness import current_stream

__all__ = ["WithinBatchPermutation", "FLOOR_FACTOR"]

#: DDP matches one device when its largest per-step relative difference (gradient, BatchNorm
#: buffers) is at most this many times the largest draw of the one-device reordering floor: the
#: one rule of ``vae-ddp equivalence``, the recipe's check, the report-scale study and the audit.
FLOOR_FACTOR = 2.0


class WithinBatchPermutation(Callback):
    """One device only: permute the samples of each training batch, each keeping its random draws.

    At training batch k (counted from the start of ``fit``) the callback draws
    ``perm = torch.randperm(B)`` from a generator seeded with ``seed * 1_000_003 + k`` and
    reorders, in place, every tensor of the batch whose first dimension is ``B``
    (``x: (B, ...)``, the labels ``(B,)``; any nesting of sequences, mappings and dataclasses,
    as Lightning walks batches): row ``i`` becomes row ``perm[i]``. The step's random draws
    follow their samples:

    - under a running [`GlobalBatchStream`][vae_ddp.fixes.randomness.GlobalBatchStream] (what
      [`GlobalBatchRandomness`][vae_ddp.fixes.randomness.GlobalBatchRandomness] installs for
      dropout masks, drop-path and ``noise``): each draw of the global batch whose batch
      dimension has ``B`` rows is permuted alike;
    - otherwise, if the LightningModule has a ``noise`` method or function (``mu -> eps``, the
      hook that [`VAE`][vae_ddp.model.VAE] and the recipe's module draw their
      reparameterization noise through, and that
      [`GlobalBatchNoise`][vae_ddp.fixes.noise.GlobalBatchNoise] sets): the noise of row ``i``
      becomes ``noise(mu)[perm[i]]``, the ``eps`` that sample met in the unpermuted run.

    The loss (a mean over the batch), its gradient and the BatchNorm statistics are then the
    same sums in another order: only floating-point rounding can tell the two runs apart.
    Draws made another way (``torch.rand`` in ``training_step``) do not follow their samples;
    the audit checks for them before it uses this floor.

    Put it after any callback that sets ``noise`` or installs the stream (Lightning calls
    callbacks in list order). Lightning converts the batch to the precision's dtype and moves
    it to the device before ``on_train_batch_start`` (``_TrainingEpochLoop.advance``, Lightning
    2.x) and passes that same object to ``training_step``, so the in-place reordering reaches
    the model.

    Args:
        seed: seed of the permutations.

    Raises:
        RuntimeError: used with more than one process.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._batch = 0
        self._perm: Optional[Tensor] = None
        self._inner: Optional[Callable[[Tensor], Tensor]] = None
        self._stream: Any = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._batch = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.world_size != 1:
            raise RuntimeError(f"WithinBatchPermutation is a one-device probe; this run has world size "
                               f"{trainer.world_size}")
        tensors = batch_tensors(batch)
        n = len(tensors[0])
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self._batch)
        perm = self._perm = torch.randperm(n, generator=g)
        for t in tensors:
            if t.dim() > 0 and len(t) == n:
                t.copy_(t[perm.to(t.device)])
        stream = current_stream()
        if stream is not None:  # every draw of the step for the global batch: permuted alike
            draw = type(stream).draw.__get__(stream)

            def permuted(fn, shape, dtype=None, device="cpu", batch_dim=0):
                out = draw(fn, shape, dtype=dtype, device=device, batch_dim=batch_dim)
                return out.index_select(batch_dim, perm.to(out.device)) if out.shape[batch_dim] == n else out

            stream.draw = permuted
            self._stream = stream
        elif callable(getattr(pl_module, "noise", None)) and not isinstance(pl_module.noise, nn.Module):
            self._inner = pl_module.noise
            pl_module.noise = self

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._stream is not None:
            self._stream.__dict__.pop("draw", None)
            self._stream = None
        elif pl_module.__dict__.get("noise") is self:  # not already restored by a callback before this one
            if getattr(self._inner, "__self__", None) is pl_module:
                del pl_module.noise  # it was the module's own method
            else:
                pl_module.noise = self._inner
        self._inner = None
        self._batch += 1

    def follow(self, draw: Tensor, batch_dim: int = 0) -> Tensor:
        """``draw`` (a random draw of this batch, ``(B, ...)`` along ``batch_dim``) with its rows
        reordered as the samples were: row ``i`` becomes row ``perm[i]``; a draw of another size,
        or outside a training batch, unchanged."""
        perm = self._perm
        if perm is None or draw.dim() == 0 or draw.shape[batch_dim] != len(perm):
            return draw
        return draw.index_select(batch_dim, perm.to(draw.device))

    def __call__(self, mu: Tensor) -> Tensor:
        """``eps`` for the permuted rows: the unpermuted ``noise(mu)[perm]``, ``mu: (B, latent_dim)``."""
        eps = self._inner(mu)
        return eps[self._perm.to(eps.device)]
