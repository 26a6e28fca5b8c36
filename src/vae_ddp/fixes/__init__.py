"""The fixes, one module each, usable in any LightningModule and Trainer.

- [`vae_ddp.fixes.noise`][vae_ddp.fixes.noise]: random streams per rank ([`PerRankSeed`][vae_ddp.fixes.noise.PerRankSeed], [`GlobalBatchNoise`][vae_ddp.fixes.noise.GlobalBatchNoise]).
- [`vae_ddp.fixes.batchnorm`][vae_ddp.fixes.batchnorm]: BatchNorm over the global batch on any backend, gloo on CPUs included ([`GlobalSyncBatchNorm`][vae_ddp.fixes.batchnorm.GlobalSyncBatchNorm]).
- [`vae_ddp.fixes.sampler`][vae_ddp.fixes.sampler]: the single-device batch split across ranks ([`GlobalBatchDistributedSampler`][vae_ddp.fixes.sampler.GlobalBatchDistributedSampler]).
"""

from vae_ddp.fixes.batchnorm import GlobalBatchNorm, GlobalSyncBatchNorm, GlooSyncBatchNorm
from vae_ddp.fixes.noise import GlobalBatchNoise, PerRankSeed
from vae_ddp.fixes.sampler import GlobalBatchDistributedSampler
from vae_ddp.fixes.registry import Factor, exposures, factors, register  # noqa: F401  (the factor registry)

__all__ = ["GlobalBatchNoise", "PerRankSeed", "GlobalBatchNorm", "GlobalSyncBatchNorm", "GlooSyncBatchNorm", "GlobalBatchDistributedSampler"]
