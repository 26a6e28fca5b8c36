"""The fixes, one module each, usable in any LightningModule and Trainer.

- [`vae_ddp.fixes.noise`][vae_ddp.fixes.noise]: random streams per rank
  ([`PerRankSeed`][vae_ddp.fixes.noise.PerRankSeed], [`GlobalBatchNoise`][vae_ddp.fixes.noise.GlobalBatchNoise]).
- [`vae_ddp.fixes.randomness`][vae_ddp.fixes.randomness]: any random draw of a training step made for the global
  batch ([`GlobalBatchRandomness`][vae_ddp.fixes.randomness.GlobalBatchRandomness],
  [`global_batch_draw`][vae_ddp.fixes.randomness.global_batch_draw],
  [`GlobalBatchStream`][vae_ddp.fixes.randomness.GlobalBatchStream]).
- [`vae_ddp.fixes.dropout`][vae_ddp.fixes.dropout]: dropout masks of the global batch
  ([`GlobalBatchDropout`][vae_ddp.fixes.dropout.GlobalBatchDropout]).
- [`vae_ddp.fixes.augmentation`][vae_ddp.fixes.augmentation]: random augmentation keyed by sample and epoch
  ([`SeededAugmentation`][vae_ddp.fixes.augmentation.SeededAugmentation]).
- [`vae_ddp.fixes.batchnorm`][vae_ddp.fixes.batchnorm]: BatchNorm over the global batch on any backend, gloo on CPUs
  included ([`GlobalSyncBatchNorm`][vae_ddp.fixes.batchnorm.GlobalSyncBatchNorm]).
- [`vae_ddp.fixes.sampler`][vae_ddp.fixes.sampler]: the single-device batch split across ranks
  ([`GlobalBatchDistributedSampler`][vae_ddp.fixes.sampler.GlobalBatchDistributedSampler]).
- [`vae_ddp.fixes.reduction`][vae_ddp.fixes.reduction]: means over a variable number of items (tokens)
  ([`global_item_mean`][vae_ddp.fixes.reduction.global_item_mean],
  [`global_token_cross_entropy`][vae_ddp.fixes.reduction.global_token_cross_entropy]).
- [`vae_ddp.fixes.logging`][vae_ddp.fixes.logging]: validation without padded duplicates
  ([`unrepeated_sampler`][vae_ddp.fixes.logging.unrepeated_sampler]).
"""

from vae_ddp.fixes.augmentation import SeededAugmentation
from vae_ddp.fixes.batchnorm import GlobalBatchNorm, GlobalSyncBatchNorm
from vae_ddp.fixes.dropout import GlobalBatchDropout, GlobalBatchDropPath
from vae_ddp.fixes.logging import padded_duplicates, unrepeated_sampler
from vae_ddp.fixes.reduction import global_item_count, global_item_mean, global_token_cross_entropy
from vae_ddp.fixes.noise import GlobalBatchNoise, PerRankSeed
from vae_ddp.fixes.randomness import GlobalBatchRandomness, GlobalBatchStream, global_batch_draw
from vae_ddp.fixes.sampler import GlobalBatchDistributedSampler
from vae_ddp.fixes.registry import Factor, exposures, factors, register  # noqa: F401  (the factor registry)

__all__ = ["GlobalBatchNoise", "PerRankSeed", "GlobalBatchNorm", "GlobalSyncBatchNorm",
           "GlobalBatchDistributedSampler",
           "GlobalBatchRandomness", "GlobalBatchStream", "global_batch_draw",
           "GlobalBatchDropout", "GlobalBatchDropPath",
           "SeededAugmentation", "global_item_count", "global_item_mean", "global_token_cross_entropy",
           "unrepeated_sampler", "padded_duplicates"]
