"""Losses averaged over a variable number of items (tokens, valid pixels, boxes) under DDP.

A loss such as ``F.cross_entropy(logits, labels, ignore_index=-100)`` is a mean over the
items of *this rank's* batch that count (labels not ``-100``). DDP then averages the
gradients of the ranks, so rank ``r``'s items get the weight ``1 / (N * n_r)``, while one
device gives every item of the global batch ``1 / sum_r n_r``. Equal per-rank batch *sizes*
do not make the item counts ``n_r`` equal, so the DDP gradient is not the one-device gradient.

The fix (what Hugging Face ``transformers`` does with ``num_items_in_batch``: its
``Trainer.get_batch_samples`` counts the labels that are not ``-100`` and, with
``average_tokens_across_devices``, gathers and sums that count over processes;
``fixed_cross_entropy`` in ``transformers/loss/loss_utils.py`` then takes
``cross_entropy(..., reduction="sum") / num_items_in_batch``; ``Trainer.compute_loss``
multiplies the loss by the number of processes to undo DDP's averaging): sum the per-item
losses on each rank, all-reduce the item count, and divide by the global count times
``1 / N``. Each rank's loss is then ``N * S_r / sum_r n_r``; DDP's average of the ranks'
gradients is the gradient of ``sum_r S_r / sum_r n_r``, the one-device global mean.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from torch.utils.data import DistributedSampler

from vae_ddp.fixes import _env
from vae_ddp.fixes.factor import Factor, Finding, Seen, samplers, world
from vae_ddp.fixes.sampler import uses_global_sampler

__all__ = ["global_item_count", "global_item_mean", "global_token_cross_entropy", "FACTOR"]


def global_item_count(count: Union[Tensor, int, float], device: Optional[torch.device] = None) -> Tensor:
    """The item count summed over all ranks (``all_reduce(SUM)`` on the default process
    group, outside autograd); the count itself without a process group.

    Args:
        count: this rank's number of items (scalar tensor or number).
        device: where the count goes for the collective (default: ``count``'s device, or
            CPU; with NCCL pass the CUDA device).

    Returns:
        Scalar ``float64`` tensor (exact for counts below 2**53).
    """
    c = torch.as_tensor(count, device=device).detach().to(torch.float64).reshape(())
    c = c.clone()
    if _env._initialized() and dist.get_world_size() > 1:
        dist.all_reduce(c, op=dist.ReduceOp.SUM)
    return c


def global_item_mean(total: Tensor, count: Union[Tensor, int, float]) -> Tensor:
    """The loss to return from ``training_step`` for a mean over a variable number of items.

    Args:
        total: this rank's *sum* of per-item losses (scalar, with autograd).
        count: this rank's number of items (scalar tensor or number).

    Returns:
        ``total * N / global_count`` in ``total``'s dtype, where ``N`` is the world size (1
        without a process group) and ``global_count`` is [`global_item_count`][vae_ddp.fixes.item_count.global_item_count]
        of ``count``. DDP's gradient average of it is the gradient of the global mean
        ``sum_r total_r / sum_r count_r``; its mean over ranks (``self.log(...,
        sync_dist=True)``) is the global mean. On one rank alone it is *not* a mean (it is
        ``N`` times the rank's share): log it with ``sync_dist=True``.

    Raises:
        ValueError: the global count is 0 (no item on any rank).

    Every rank must call it at every step (it is a collective).
    """
    n_global = global_item_count(count, device=total.device)
    if float(n_global) == 0:
        raise ValueError("no item to average over on any rank (global count 0): the loss is undefined")
    world = _env.world_size()
    return total * (world / n_global).to(total.dtype)


def global_token_cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100) -> Tensor:
    """``F.cross_entropy(logits, target, ignore_index=ignore_index)`` as one device computes it
    over the global batch, for use under DDP: the per-token sum over this rank divided by
    the global token count (see [`global_item_mean`][vae_ddp.fixes.item_count.global_item_mean]).

    Args:
        logits: ``(M, V)`` float scores for ``M`` tokens and ``V`` classes (flatten ``(b, T, V)``).
        target: ``(M,)`` int64 class indices, ``ignore_index`` where a token does not count.
        ignore_index: the label of tokens that do not count (``-100`` as in torch and
            ``transformers``).

    Returns:
        Scalar tensor; see [`global_item_mean`][vae_ddp.fixes.item_count.global_item_mean].

    Raises:
        ValueError: no token counts on any rank.
    """
    total = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")
    return global_item_mean(total, (target != ignore_index).sum())


# --- the factor (Mean reduction): its exposure check and what DDPAudit watches; the sampler's
# switch fixes what the project's own runs are exposed to (equal per-rank batches)

def _check(trainer, module, datamodule) -> Optional[str]:
    n = world(trainer)
    if n == 1 or datamodule is None or uses_global_sampler(datamodule):
        return None
    if getattr(datamodule, "dataset_train", None) is None and hasattr(datamodule, "setup"):
        datamodule.setup("fit")
    size, b = len(datamodule.dataset_train), int(datamodule.batch_size)
    if size % n:
        return (f"{size} training samples on {n} ranks: DistributedSampler pads with {n - size % n} repeated "
                f"sample(s), counted twice in the mean")
    per_rank = size // n
    if per_rank % b and not getattr(datamodule, "drop_last", False):
        return (f"the last per-device batch has {per_rank % b} of {b} samples: the average of per-rank means "
                f"weights its samples more; drop incomplete global batches")
    return None


def _watch_padding(seen: Seen) -> list:
    """``train_start``: a ``DistributedSampler`` that pads the training or validation set with
    repeated samples up to a multiple of the world size."""
    padded = []
    for where, loaders in (("train", seen.trainer.train_dataloader), ("validation", seen.trainer.val_dataloaders)):
        for s in samplers(loaders):
            if isinstance(s, DistributedSampler) and not s.drop_last and s.total_size > len(s.dataset):
                padded.append(f"{where}: {s.total_size - len(s.dataset)} repeated of {len(s.dataset)}")
    if not padded:
        return []
    return [Finding("reduction", "DistributedSampler pads to a multiple of the world size, repeated samples count "
                    f"twice in the mean ({'; '.join(padded)})",
                    "drop_last=True for training; for evaluation an unrepeated sampler with metrics that sum "
                    "their states across ranks (torchmetrics)")]


FACTOR = Factor(
    key="reduction", name="Mean reduction", page="factors/reduction.md",
    changes="equal per-rank batches: incomplete global batches dropped by the sampler switch",
    check=_check, fixed_by="sampler", watch={"train_start": _watch_padding},
    clean="no padded samples")
