"""The fixes, one module each, usable in any LightningModule and Trainer.

- :mod:`vae_ddp.fixes.noise`: random streams per rank (:class:`PerRankSeed`, :class:`GlobalBatchNoise`).
- :mod:`vae_ddp.fixes.batchnorm`: BatchNorm over the global batch on CPU/gloo (:class:`GlooSyncBatchNorm`).
- :mod:`vae_ddp.fixes.sampler`: the single-device batch split across ranks (:class:`GlobalBatchDistributedSampler`).
"""

from vae_ddp.fixes.batchnorm import GlobalBatchNorm, GlooSyncBatchNorm
from vae_ddp.fixes.noise import GlobalBatchNoise, PerRankSeed
from vae_ddp.fixes.sampler import GlobalBatchDistributedSampler

__all__ = ["GlobalBatchNoise", "PerRankSeed", "GlobalBatchNorm", "GlooSyncBatchNorm", "GlobalBatchDistributedSampler"]
