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
  is then the same for any world size, single device included. It is the ``noise``-only
  case of [`GlobalBatchRandomness`][vae_ddp.fixes.randomness.GlobalBatchRandomness], which also
  covers dropout and any draw made through [`global_batch_draw`][vae_ddp.fixes.randomness.global_batch_draw].
"""

from __future__ import annotations

import random
from typing import Optional

import numpy as np
import torch
from pytorch_lightning import Callback, LightningModule, Trainer

from vae_ddp.fixes.dropout import SWAPPABLE
from vae_ddp.fixes.randomness import GlobalBatchRandomness

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


class GlobalBatchNoise(GlobalBatchRandomness):
    """Reparameterization noise drawn for the global batch and sliced by rank.

    At training batch k (counted from the start of ``fit``), every rank seeds a private
    ``torch.Generator`` with ``seed * 1_000_003 + k``, draws ``eps`` of shape
    ``(world_size * b, *mu.shape[1:])`` and keeps rows ``[rank * b, (rank + 1) * b)``,
    where ``b = mu.shape[0]`` is the per-device batch size. With
    [`GlobalBatchDistributedSampler`][vae_ddp.fixes.sampler.GlobalBatchDistributedSampler] (rank r holds chunk r
    of the global batch), sample i of global batch k gets the same ``eps`` for every
    world size. The global generator is not touched.

    It is [`GlobalBatchRandomness`][vae_ddp.fixes.randomness.GlobalBatchRandomness] restricted to
    the ``noise`` attribute (``dropout=False``): the LightningModule must draw its noise
    through it (``eps = self.noise(mu)``) as [`VAE`][vae_ddp.model.VAE] does; the callback
    sets it for the duration of each training batch and restores the module's own
    afterwards (validation keeps the default stream; a module without a ``noise``
    attribute is left without one). It warns once (rank 0) when the module has other
    random layers (``nn.Dropout``: use ``GlobalBatchRandomness``) or never called
    ``self.noise``. Assumes equal per-device batch sizes (true with the sampler above).

    Args:
        seed: base seed, the same on every rank; default: ``seed_everything``'s seed
            (``PL_GLOBAL_SEED``), else 0.
    """

    fix_name = "GlobalBatchNoise"

    def __init__(self, seed: Optional[int] = None) -> None:
        super().__init__(seed, dropout=False, noise=True)

    def _unused_hint(self, pl_module: LightningModule) -> str:
        if not hasattr(pl_module, "noise"):
            why = f"{type(pl_module).__name__} has no `noise` attribute (it serves only `eps = self.noise(mu)`)"
        else:
            why = "training_step never called `self.noise(...)`"
        dropout = any(isinstance(m, SWAPPABLE) and m.p > 0 for m in pl_module.modules())
        hint = ("; its randomness is nn.Dropout: use GlobalBatchRandomness(), which swaps nn.Dropout for "
                "GlobalBatchDropout during fit") if dropout else (
            "; draw through vae_ddp.fixes.global_batch_draw (or a `noise` attribute) and use GlobalBatchRandomness()")
        return why + hint
