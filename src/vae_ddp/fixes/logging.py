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
  [`unrepeated_sampler`][vae_ddp.fixes.logging.unrepeated_sampler] builds it with or without
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

from typing import Any, Optional

import torch
from pytorch_lightning.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import Dataset

from vae_ddp.fixes import _env
from vae_ddp.fixes.factor import (Audit, Factor, Finding, FixParts, Seen, Switch, batch_tensors, gather_ints,
                                   gather_objects, world)

__all__ = ["unrepeated_sampler", "padded_duplicates", "FACTOR"]


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


# --- the factor (Logging): its exposure check, what its fix adds, and what DDPAudit watches -------

def _check(trainer, module, datamodule) -> Optional[str]:
    if world(trainer) > 1 and not getattr(module, "sync_dist_logging", False):
        return "self.log without sync_dist=True logs rank 0's share of the batch, not the global batch"
    return None


def _parts(spec, seed: int) -> FixParts:
    return FixParts(module={"sync_dist_logging": True})


def _logged(metric: Any) -> list:
    """What a tensor metric of Lightning's ``_ResultMetric`` holds after a batch (its accumulated
    value, sample count and last step's value, Lightning 2.x), as floats: what rank 0 logs."""
    parts = [getattr(metric, name, None) for name in ("value", "cumulated_batch_size", "_forward_cache")]
    return [torch.as_tensor(p).detach().double().cpu().reshape(-1).tolist()
            for p in parts if isinstance(p, torch.Tensor)]


def _watch_unsynced(seen: Seen, where: str = "", share: str = "the batch") -> list:
    """``train_batch_end`` (first batch): metrics logged as tensors without ``sync_dist`` whose values
    differ across the ranks (a constant, a weight or a schedule's value, logged alike on every rank is
    rank 0's value and the global one alike); ``where``, ``share``: the validation's words."""
    results = seen.trainer._results  # the active loop's _ResultCollection (Lightning 2.x)
    if results is None:
        return []
    candidates = {m.meta.name: _logged(m) for m in results.values()
                  if getattr(m, "is_tensor", False) and not m.meta.sync.should}
    ranks = gather_objects(candidates)  # every rank calls it, whatever it logged
    unsynced = sorted(name for name in candidates
                      if len(ranks) < 2 or any(r.get(name) != candidates[name] for r in ranks))
    if not unsynced:
        return []
    names = ", ".join(unsynced[:4])
    return [Finding("logging", f"{where}{len(unsynced)} metric(s) logged without sync_dist ({names}): "
                    f"under DDP the logged value is rank 0's share of {share}",
                    "self.log(name, value, sync_dist=True, batch_size=len(batch[0]))")]


def _watch_count(seen: Seen) -> list:
    """``validation_batch_end``: count this rank's validation samples; at the first batch, the metrics the
    validation logs without ``sync_dist`` whose values differ across the ranks (as ``train_batch_end``'s; Lightning
    itself only warns of them)."""
    tensors = batch_tensors(seen.batch)
    first = "samples" not in seen.state
    seen.state["samples"] = seen.state.get("samples", 0) + (len(tensors[0]) if tensors and tensors[0].dim() > 0 else 0)
    return _watch_unsynced(seen, "validation: ", "the validation set") if first else []


def _watch_epoch_mean(seen: Seen) -> list:
    """``validation_epoch_end`` (the first): metrics logged as tensors with ``sync_dist=True`` on
    ranks whose sample counts add up to a total the world size does not divide. Lightning
    averages the ranks' counts in an integer tensor at the epoch end (``cumulated_batch_size``,
    Lightning 2.x; issues #21838, #21859), so the epoch mean is too large by
    ``(total / N) / floor(total / N)``."""
    results = seen.trainer._results  # the validation loop's _ResultCollection here (Lightning 2.x)
    names = sorted({m.meta.name for m in (results.values() if results is not None else [])
                    if getattr(m, "is_tensor", False) and m.meta.sync.should and m.meta.on_epoch})
    counts = gather_ints(seen.state.get("samples", 0))
    n, total = len(counts), sum(counts)
    if not names or n < 2 or total % n == 0:
        return []
    factor = (total / n) / (total // n)
    return [Finding(
        "logging", f"validation: the ranks hold {', '.join(map(str, counts))} samples ({total} in all) and log "
        f"{', '.join(names[:4])} with sync_dist=True: Lightning averages the ranks' counts in an integer tensor "
        f"at the epoch end, so the epoch mean is {factor:.4g}x the true mean (Lightning issues #21838, #21859)",
        "log a torchmetrics.MeanMetric updated with (value, weight=batch size) as an object, "
        "self.log(name, metric), whose states are summed over the ranks (vae_ddp.fixes.logging)")]


FACTOR = Factor(
    position=5, key="logging", name="Logging", page="factors/logging.md",
    changes="module hook: self.log(..., sync_dist=True, batch_size=len(x))",
    check=_check,
    switch=Switch("sync_dist_logging", default=False, fixed=True, choices=(True,), parts=_parts,
                  off_label="logging back to rank 0"),
    audit=Audit(mechanism="plot", watch={"train_batch_end": _watch_unsynced, "validation_batch_end": _watch_count,
                       "validation_epoch_end": _watch_epoch_mean},
                clean="every logged metric synchronised (or none logged)"))
