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

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from torch.utils.data import DistributedSampler

from vae_ddp.fixes import _env
from vae_ddp.fixes.factor import Audit, CannotTell, Factor, Finding, Seen, cast_batch, chunk_batch, samplers, world
from vae_ddp.fixes.sampler import uses_global_sampler

__all__ = ["global_item_count", "global_item_mean", "global_token_cross_entropy", "reduction", "reduction_gap",
           "REDUCTION_TOLERANCE", "FACTOR"]


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
        without a process group) and ``global_count`` is
        [`global_item_count`][vae_ddp.fixes.reduction.global_item_count] of ``count``. DDP's gradient
        average of it is the gradient of the global mean ``sum_r total_r / sum_r count_r``; its mean
        over ranks (``self.log(..., sync_dist=True)``) is the global mean. On one rank alone it is *not* a mean (it is
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
    the global token count (see [`global_item_mean`][vae_ddp.fixes.reduction.global_item_mean]).

    Args:
        logits: ``(M, V)`` float scores for ``M`` tokens and ``V`` classes (flatten ``(b, T, V)``).
        target: ``(M,)`` int64 class indices, ``ignore_index`` where a token does not count.
        ignore_index: the label of tokens that do not count (``-100`` as in torch and
            ``transformers``).

    Returns:
        Scalar tensor; see [`global_item_mean`][vae_ddp.fixes.reduction.global_item_mean].

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
    size = len(datamodule.dataset_train)
    b = int(getattr(datamodule, "per_device_batch_size", None) or datamodule.batch_size)
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
                    "their states across ranks (torchmetrics)",
                    details={"mechanism": "same distribution"})]  # which samples, of one device's distribution


def _grad(model: Any, batch: Any, seed: int = 0, state: Optional["_State"] = None) -> torch.Tensor:
    """The gradient of ``batch`` (torch seeded with ``seed``), from ``state`` when given (else from
    the state the module is in), as one vector over ``model.parameters()``."""
    if state is not None:
        state.restore()
    model.zero_grad(set_to_none=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        out = model.training_step(batch, 0)
    loss = out["loss"] if isinstance(out, dict) else out
    loss.backward()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters()])


class _State:
    """The module's parameters and buffers (persistent or not) as they are now, to start each call
    of the step from: a step that writes its own state (a queue of keys, a running normaliser, a
    momentum encoder) would otherwise start every call from what the call before left."""

    def __init__(self, model: Any) -> None:
        self.named = [(n, t) for n, t in [*model.named_parameters(), *model.named_buffers()]]
        self.saved = [t.detach().clone() for _, t in self.named]

    def restore(self) -> None:
        with torch.no_grad():
            for (_, t), v in zip(self.named, self.saved):
                t.copy_(v)

    def written(self) -> list[str]:
        """The parameters and buffers whose values differ from the saved ones."""
        return [n for (n, t), v in zip(self.named, self.saved) if not torch.equal(t.detach(), v)]


def reduction_gap(model: Any, batch: Any, n: int) -> Optional[float]:
    """``max |g(batch) - mean_r g(chunk_r)| / max |g(batch)|`` in float64 and eval mode; None
    for manual optimization (``training_step`` steps the optimizers itself)."""
    found = reduction(model, batch, n)
    return None if found is None else found[0]


def reduction(model: Any, batch: Any, n: int) -> Optional[tuple[float, str]]:
    """How the loss reduces the batch: ``(gap, kind)``, ``gap`` as in
    [`reduction_gap`][vae_ddp.fixes.reduction.reduction_gap] and ``kind`` from the least-squares fit
    ``g(batch) = sum_r a_r g(chunk_r)`` over the ``n`` per-rank chunks (float64, eval mode):

    - ``"mean"``: every ``a_r = 1/n``: a mean over samples (what DDP's gradient average assumes);
    - ``"sum"``: every ``a_r = 1``: a sum over the batch (DDP's average is 1/n of one device's);
    - ``"weighted"``: other weights, e.g. a mean over a number of tokens that differs per chunk;
    - ``"coupled"``: no such weights fit (relative residual above 1e-6): the loss of a sample
      depends on the other samples of its batch (in-batch negatives, a contrastive loss).
    - ``"random"``: the gradient of the global batch changes with torch's seed (``torch.randn``
      in ``training_step``, drawn in eval mode too): ``gap`` is that change, and how the loss
      reduces the batch cannot be told from draws that differ between the batch and its chunks.

    Every call of the step starts from the module's state as it was given (its parameters and
    buffers restored, and restored at the end): a step that writes its own state (a queue, a
    running normaliser, a momentum encoder) is not a random one. Randomness is measured from the
    same state with two seeds, state by a second call with the same seed from what the first
    left (:func:`measure_reduction`); a normaliser updated from the batch before the loss reads it is then a
    loss that couples the samples (``"coupled"``), as it is.

    None for manual optimization (``training_step`` steps the optimizers itself)."""
    found = measure_reduction(model, batch, n)
    return None if found is None else found[:2]


def measure_reduction(model: Any, batch: Any, n: int) -> Optional[tuple[float, str, list[str], float]]:
    """:func:`reduction`'s ``(gap, kind)`` and what it measured of the step's own state: the names of
    the parameters and buffers one call of ``training_step`` writes, and how far a second call with
    the same seed, from what the first left, moves the gradient (relative to its largest element)."""
    if not model.automatic_optimization:
        return None
    model = model.double()
    was_training = model.training
    model.eval()
    state = _State(model)
    try:
        batch = cast_batch(batch, torch.float64)
        full = _grad(model, batch, state=state)
        again = _grad(model, batch)  # the same seed, from what the first call left
        written = state.written()
        reseeded = _grad(model, batch, seed=1, state=state)
        chunks = torch.stack([_grad(model, c, state=state) for c in chunk_batch(batch, n)])  # (n, P)
    finally:
        state.restore()
        model.train(was_training)
        model.zero_grad(set_to_none=True)
    scale = float(full.abs().max())
    same_seed = float((full - again).abs().max()) / scale if scale > 0 else 0.0
    drawn = float((full - reseeded).abs().max()) / scale if scale > 0 else 0.0
    if drawn > REDUCTION_TOLERANCE:
        return drawn, "random", written, same_seed
    gap = float((full - chunks.mean(0)).abs().max()) / scale if scale > 0 else 0.0
    if gap <= REDUCTION_TOLERANCE:
        return gap, "mean", written, same_seed
    a = torch.linalg.lstsq(chunks.T, full.unsqueeze(1)).solution.squeeze(1)  # (n,)
    residual = float((chunks.T @ a - full).norm() / full.norm())
    if residual > 1e-6:
        return gap, "coupled", written, same_seed
    if bool(((a - 1.0).abs() < 1e-6).all()):
        return gap, "sum", written, same_seed
    return gap, "weighted", written, same_seed


#: what each kind of reduction gets: (evidence, fix); the evidence is preceded by the measured gap
_REDUCTIONS = {
    "sum": ("the loss is a sum over the batch, not a mean: DDP averages the ranks' sums over b samples, so its "
            "gradient is 1/N of one device's sum over the global batch",
            "multiply the summed loss by the world size, loss * self.trainer.world_size, so that DDP's average of "
            "the ranks' sums is one device's sum (or return the mean over the batch, on one device and under DDP "
            "alike; see the summed-loss question page)"),
    "weighted": ("the loss is a mean over a number of items that differs per rank (e.g. a mean over the valid "
                 "tokens of each rank's batch): DDP averages the ranks' means with equal weights",
                 "average over the global item count: all-reduce the number of items (tokens, pixels, boxes) and "
                 "divide the summed loss by it (times the world size, as DDP averages); "
                 "vae_ddp.fixes.global_token_cross_entropy(logits, targets) for tokens, "
                 "vae_ddp.fixes.global_item_mean(summed_loss, item_count) for any per-item loss"),
    "coupled": ("the loss of a sample depends on the other samples of its batch (in-batch negatives, a contrastive "
                "or ranking loss): each rank's loss sees only its own b samples, one device's all B",
                "when the samples meet through their outputs (in-batch negatives, a ranking, the hardest examples of "
                "the batch), gather the embeddings of every rank with gradients, self.all_gather(z, sync_grads=True), "
                "and compute the loss over the global batch (see the in-batch negatives question page); when they "
                "meet only through a statistic of the batch (class weights from its label counts, a normaliser), "
                "all-reduce that statistic instead (torch.distributed.all_reduce of the counts), no gradient needed"),
}


#: A relative gradient gap above this is a loss that is not a per-sample mean (float64 rounding is ~1e-15).
REDUCTION_TOLERANCE = 1e-9


def _before(model: Any, datamodule: Any, batches: list, n: int) -> list[Finding]:
    """The one-process check of `vae-ddp audit`: the largest gap over ``batches`` and the kind
    the batches agree on first (coupled, then weighted, then sum): a mean over tokens equals the
    global mean on a batch whose chunks happen to hold as many tokens each, so one batch can hide it."""
    measured = [r for r in (measure_reduction(model, b, n) for b in batches) if r is not None]
    written = sorted({name for r in measured for name in r[2]})
    found = [r[:2] for r in measured if r[0] > REDUCTION_TOLERANCE]
    drawn = [g for g, kind in found if kind == "random"]
    if drawn:  # the check cannot tell the reduction from the draws
        raise CannotTell("the one-process check of the loss reduction was skipped: the gradient of the same "
                         f"batch, from the same weights and buffers, changes with torch's seed ({max(drawn):.3g} "
                         "relative, in eval mode), so it cannot tell how the loss reduces the batch; "
                         "the DDP runs compare it")
    if not found:
        return []
    gap = max(g for g, _ in found)
    kind = next(k for k in ("coupled", "weighted", "sum") if any(kk == k for _, kk in found))
    evidence, fix = _REDUCTIONS[kind]
    # measured without a process group: `vae-ddp audit` asks again under the real one ("recheck")
    state = (f" (training_step writes {', '.join(written)}: a second call with the same seed moves the gradient by "
             f"{max(r[3] for r in measured):.3g}, so every call started from the same state)" if written else "")
    return [Finding(FACTOR.key, f"{evidence}; the gradient of the global batch differs from the mean of its {n} "
                                f"per-rank chunks' gradients by {gap:.3g} (relative){state}",
                    fix, manual=True, details={"kind": kind, "recheck": True})]


FACTOR = Factor(
    position=4, key="reduction", name="Mean reduction", page="factors/reduction.md",
    changes="equal per-rank batches: incomplete global batches dropped by the sampler switch",
    check=_check, fixed_by="sampler",
    # the audit's sampler fix (global batches, the last one dropped) removes the padding
    audit=Audit(watch={"train_start": _watch_padding}, before=_before, ablated_with="sampler",
                clean="no padded samples"))
