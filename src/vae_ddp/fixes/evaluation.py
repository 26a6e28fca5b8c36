"""Validation and test metrics over each sample exactly once, on any world size.

Under ``strategy="ddp"`` Lightning gives validation and test loaders a
``DistributedSampler(shuffle=False)`` (``_get_distributed_sampler``, Lightning 2.x), which
pads the set with repeated samples until its size divides by the world size: with 101
samples on 2 ranks, sample 0 is evaluated twice (102 in all). Logging with
``sync_dist=True`` then weighs each rank's mean by its sample count, the duplicate
included, so the duplicate counts and the metric is not the one-device metric.

The fix uses what Lightning and torchmetrics provide:

- Lightning's ``UnrepeatedDistributedSampler`` (``pytorch_lightning.overrides.distributed``,
  the sampler Lightning uses for ``predict``): rank ``r`` takes ``indices[r::N]``, no
  padding, so the ranks hold ``ceil(n/N)`` or ``floor(n/N)`` samples.
  [`unrepeated_sampler`][vae_ddp.fixes.evaluation.unrepeated_sampler] builds it with or without
  a process group. Lightning keeps a ``DistributedSampler`` subclass that a loader already
  has (``_requires_distributed_sampler``).
- a torchmetrics metric (e.g. ``MulticlassAccuracy(average="micro")``, ``MeanMetric``)
  logged as an object: its states (counts, sums, weights) are *summed* over ranks
  (``dist_reduce_fx="sum"``) when ``compute`` runs at the epoch end, so unequal per-rank
  counts weigh correctly. ``self.log(name, tensor, sync_dist=True, batch_size=b)`` weighs
  the ranks by their sample counts too, but at the epoch end Lightning averages those counts
  over the ranks in an integer tensor (``cumulated_batch_size`` of ``_ResultMetric``,
  Lightning 2.x): when the ranks' counts add up to a number that the world size does not
  divide, the average is rounded down and the epoch mean comes out too large, by the total
  over the world size divided by that rounded-down average (Lightning issues #21838 and
  #21859). With equal per-rank counts it is exact.

Ranks then run different numbers of validation batches: nothing in ``validation_step``
may call a collective per batch (no ``sync_dist=True`` on step values, no ``all_gather``).
"""

from __future__ import annotations

from typing import Optional

from pytorch_lightning.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import Dataset

from vae_ddp.fixes import _env

__all__ = ["unrepeated_sampler", "padded_duplicates"]


def unrepeated_sampler(dataset: Dataset, num_replicas: Optional[int] = None,
                       rank: Optional[int] = None) -> UnrepeatedDistributedSampler:
    """Lightning's ``UnrepeatedDistributedSampler(dataset, shuffle=False)`` for evaluation.

    Args:
        dataset: map-style dataset of length ``n`` (at least ``num_replicas`` samples).
        num_replicas: world size ``N``; default: from the process group, 1 without one
            (in a LightningDataModule pass ``self.trainer.world_size``).
        rank: global rank; default: from the process group, 0 without one
            (``self.trainer.global_rank``).

    Returns:
        A sampler yielding ``range(n)[rank::N]``: over all ranks each index exactly once.

    Raises:
        ValueError: ``rank`` outside ``[0, N)``, or fewer samples than ranks (a rank
            without a batch would leave the others waiting in a collective).
    """
    world, r = _env.world_size(num_replicas), _env.rank(rank)
    if len(dataset) < world:  # type: ignore[arg-type]
        raise ValueError(f"evaluation set of {len(dataset)} samples is smaller than the world size {world}: "  # type: ignore[arg-type]
                         f"every rank needs at least one sample")
    return UnrepeatedDistributedSampler(dataset, num_replicas=world, rank=r, shuffle=False)


def padded_duplicates(n: int, world_size: int) -> int:
    """How many samples ``DistributedSampler(drop_last=False)`` repeats to pad ``n`` samples to
    a multiple of ``world_size`` (``ceil(n / N) * N - n``, torch's ``total_size - n``)."""
    return (-n) % world_size
