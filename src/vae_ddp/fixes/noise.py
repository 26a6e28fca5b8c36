"""Fixes for random streams per rank.

``seed_everything(seed)`` seeds every DDP process with the same seed, so every draw made
inside ``training_step`` (the reparameterization noise ``eps`` of ``q.rsample()``, dropout
masks, random augmentations) is the same on every rank, step after step: rank 1's half
batch gets the same ``eps`` rows as rank 0's. Two fixes:

- [`PerRankSeed`][vae_ddp.fixes.noise.PerRankSeed]: reseed each rank's global generator with ``seed + global_rank``
  once the process group exists. Independent noise per rank, but the noise still depends
  on the world size, so DDP(N) is not DDP(M) nor single.
- [`GlobalBatchNoise`][vae_ddp.fixes.noise.GlobalBatchNoise]: draw ``eps`` for the whole global batch from a generator
  that every rank seeds alike, and keep this rank's rows. The noise of sample i at step k
  is then the same for any world size, single device included.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Optional

import numpy as np
import torch
from pytorch_lightning import Callback, LightningModule, Trainer
from torch import Tensor

from vae_ddp.model import standard_normal_noise

__all__ = ["PerRankSeed", "GlobalBatchNoise"]


class PerRankSeed(Callback):
    """Seed torch, numpy and ``random`` with ``seed + trainer.global_rank`` in ``setup``.

    Lightning calls ``Callback.setup`` after the strategy has set up the process group
    (``Trainer._run``: ``strategy.setup_environment()`` then the setup hooks), i.e. after
    the model was built, so the initial weights are untouched (DDP broadcasts rank 0's
    anyway). It deliberately does not call ``seed_everything(seed + rank)``: that would
    set ``PL_GLOBAL_SEED``, which Lightning 2.x uses to seed ``DistributedSampler``, and
    the ranks would then shuffle with different permutations.

    Args:
        seed: the run's seed (the one given to ``seed_everything``).
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        s = self.seed + trainer.global_rank
        torch.manual_seed(s)
        np.random.seed(s % 2**32)
        random.seed(s)


class GlobalBatchNoise(Callback):
    """Reparameterization noise drawn for the global batch and sliced by rank.

    At training batch k (counted from the start of ``fit``), every rank seeds a private
    ``torch.Generator`` with ``seed * 1_000_003 + k``, draws ``eps`` of shape
    ``(world_size * b, *mu.shape[1:])`` and keeps rows ``[rank * b, (rank + 1) * b)``,
    where ``b = mu.shape[0]`` is the per-device batch size. With
    [`GlobalBatchDistributedSampler`][vae_ddp.fixes.sampler.GlobalBatchDistributedSampler] (rank r holds chunk r
    of the global batch), sample i of global batch k gets the same ``eps`` for every
    world size. The global generator is not touched.

    The LightningModule must draw its noise through a ``noise`` attribute
    (``eps = self.noise(mu)``) as [`VAE`][vae_ddp.model.VAE] does; the callback sets it
    for the duration of each training batch and restores it afterwards, so validation
    keeps the default stream. Assumes equal per-device batch sizes (true with the
    sampler above).

    Args:
        seed: base seed, the same on every rank.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._batch = 0
        self._rank, self._world = 0, 1
        self._saved: Optional[Callable[[Tensor], Tensor]] = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._batch = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._rank, self._world = trainer.global_rank, trainer.world_size
        self._saved = getattr(pl_module, "noise", standard_normal_noise)
        pl_module.noise = self

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        pl_module.noise = self._saved or standard_normal_noise
        self._batch += 1

    def __call__(self, mu: Tensor) -> Tensor:
        """``eps`` for this rank's rows: same shape, dtype and device as ``mu: (b, latent_dim)``."""
        b = mu.shape[0]
        g = torch.Generator(device=mu.device)
        g.manual_seed(self.seed * 1_000_003 + self._batch)
        eps = torch.randn((self._world * b, *mu.shape[1:]), generator=g, dtype=mu.dtype, device=mu.device)
        return eps[self._rank * b:(self._rank + 1) * b]
