"""Checks of the audit made in one process, before any training, on the first global batches.

- ``reduction``: is the loss a mean over samples? With the same weights, the gradient of
  the global batch must equal the mean of the gradients of its N per-rank chunks (what
  DDP's gradient all-reduce averages). A loss averaged over a variable number of items
  per rank (tokens with ``ignore_index``, valid pixels, boxes) breaks it. Measured in
  eval mode (BatchNorm with running statistics, no dropout) so only the reduction differs.
- ``noise`` (augmentation): does the dataset return different values for the same index
  on two reads? Random augmentation in ``__getitem__`` is drawn in the DataLoader workers
  from seeds that derive from the same base seed on every rank, and per sample differently
  for every world size. And does the loader's ``collate_fn`` return different batches for the
  same samples? A batch-level draw there (mixup's lambda and pairing) is made from the same
  seed on every rank, over B/N samples instead of B.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from pytorch_lightning import LightningDataModule, LightningModule

from vae_ddp.fixes.factor import batch_tensors

__all__ = ["batch_tensors", "reduction", "reduction_gap", "dataset_is_random", "collate_is_random", "static_findings"]


def _cast(batch: Any, dtype: torch.dtype) -> Any:
    from lightning_utilities.core.apply_func import apply_to_collection

    return apply_to_collection(batch, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)


def _chunk(batch: Any, n: int) -> list[Any]:
    from lightning_utilities.core.apply_func import apply_to_collection

    if not batch_tensors(batch):
        raise TypeError(f"cannot split a batch of type {type(batch).__name__}")
    return [apply_to_collection(batch, torch.Tensor, lambda t, i=i: t.chunk(n)[i]) for i in range(n)]


def _grad(model: LightningModule, batch: Any) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    with torch.random.fork_rng():
        out = model.training_step(batch, 0)
    loss = out["loss"] if isinstance(out, dict) else out
    loss.backward()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters()])


def reduction_gap(model: LightningModule, batch: Any, n: int) -> Optional[float]:
    """``max |g(batch) - mean_r g(chunk_r)| / max |g(batch)|`` in float64 and eval mode; None
    for manual optimization (``training_step`` steps the optimizers itself)."""
    found = reduction(model, batch, n)
    return None if found is None else found[0]


def reduction(model: LightningModule, batch: Any, n: int) -> Optional[tuple[float, str]]:
    """How the loss reduces the batch: ``(gap, kind)``, ``gap`` as in
    [`reduction_gap`][vae_ddp.audit.static.reduction_gap] and ``kind`` from the least-squares fit
    ``g(batch) = sum_r a_r g(chunk_r)`` over the ``n`` per-rank chunks (float64, eval mode):

    - ``"mean"``: every ``a_r = 1/n``: a mean over samples (what DDP's gradient average assumes);
    - ``"sum"``: every ``a_r = 1``: a sum over the batch (DDP's average is 1/n of one device's);
    - ``"weighted"``: other weights, e.g. a mean over a number of tokens that differs per chunk;
    - ``"coupled"``: no such weights fit (relative residual above 1e-6): the loss of a sample
      depends on the other samples of its batch (in-batch negatives, a contrastive loss).

    None for manual optimization (``training_step`` steps the optimizers itself)."""
    if not model.automatic_optimization:
        return None
    model = model.double()
    was_training = model.training
    model.eval()
    try:
        batch = _cast(batch, torch.float64)
        full = _grad(model, batch)
        chunks = torch.stack([_grad(model, c) for c in _chunk(batch, n)])  # (n, P)
    finally:
        model.train(was_training)
        model.zero_grad(set_to_none=True)
    scale = float(full.abs().max())
    gap = float((full - chunks.mean(0)).abs().max()) / scale if scale > 0 else 0.0
    if gap <= REDUCTION_TOLERANCE:
        return gap, "mean"
    a = torch.linalg.lstsq(chunks.T, full.unsqueeze(1)).solution.squeeze(1)  # (n,)
    residual = float((chunks.T @ a - full).norm() / full.norm())
    if residual > 1e-6:
        return gap, "coupled"
    if bool(((a - 1.0).abs() < 1e-6).all()):
        return gap, "sum"
    return gap, "weighted"


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
                "gather the embeddings of every rank with gradients, self.all_gather(z, sync_grads=True), and "
                "compute the loss over the global batch (see the in-batch negatives question page)"),
}


def dataset_is_random(dm: LightningDataModule) -> bool:
    """Two reads of sample 0 of the training set differ (random augmentation in ``__getitem__``)."""
    ds = dm.train_dataloader().dataset
    if len(ds) == 0:
        return False
    with torch.random.fork_rng():
        a, b = ds[0], ds[0]
    ta, tb = batch_tensors(a), batch_tensors(b)
    return any(not torch.equal(x, y) for x, y in zip(ta, tb))


def collate_is_random(dm: LightningDataModule, samples: int = 4) -> bool:
    """Two calls of the training loader's ``collate_fn`` on the same first ``samples`` samples
    differ (random draws at batch level, e.g. mixup)."""
    dl = dm.train_dataloader()
    ds = dl.dataset
    n = min(samples, len(ds))
    if n == 0 or dl.collate_fn is None:
        return False
    with torch.random.fork_rng():
        items = [ds[i] for i in range(n)]
        torch.manual_seed(0)
        a = dl.collate_fn(items)
        torch.manual_seed(1)
        b = dl.collate_fn(items)
    ta, tb = batch_tensors(a), batch_tensors(b)
    return len(ta) != len(tb) or any(x.shape != y.shape or not torch.equal(x, y) for x, y in zip(ta, tb))


#: A relative gradient gap above this is a loss that is not a per-sample mean (float64 rounding is ~1e-15).
REDUCTION_TOLERANCE = 1e-9


def static_findings(model: LightningModule, dm: LightningDataModule, batches: list, n: int) -> list[dict]:
    """The findings of both checks, as ``{"factor", "evidence", "fix", "page", "fixable": False}``.

    ``batches``: a few global batches of the training loader; the reduction check takes the
    largest gap over them (a mean over tokens equals the global mean on a batch whose chunks
    happen to hold as many tokens each, so one batch can hide it)."""
    out = []
    found = [r for r in (reduction(model, b, n) for b in batches) if r is not None and r[0] > REDUCTION_TOLERANCE]
    if found:  # the largest gap, and the kind the batches agree on first: coupled, then weighted, then sum
        gap = max(g for g, _ in found)
        kind = next(k for k in ("coupled", "weighted", "sum") if any(kk == k for _, kk in found))
        evidence, fix = _REDUCTIONS[kind]
        out.append({"factor": "reduction", "fixable": False, "page": "factors/reduction.md", "kind": kind,
                    "evidence": f"{evidence}; the gradient of the global batch differs from the mean of its {n} "
                                f"per-rank chunks' gradients by {gap:.3g} (relative)",
                    "fix": fix})
    if dataset_is_random(dm):
        out.append({"factor": "noise", "fixable": False, "page": "factors/noise.md",
                    "evidence": "the dataset draws random augmentation in __getitem__: the same draws on every rank "
                                "(worker seeds derive from the same base seed) and a different draw per sample for "
                                "every world size",
                    "fix": "draw each sample's augmentation from generators seeded with (seed, epoch, index): "
                           "vae_ddp.fixes.SeededAugmentation(dataset, transform)"})
    if collate_is_random(dm):
        out.append({"factor": "noise", "fixable": False, "page": "factors/noise.md",
                    "evidence": "the DataLoader's collate_fn draws random numbers (e.g. batch-level mixup): every rank "
                                "draws the same ones (the same seed), and a draw over the per-device batch is not the "
                                "one-device draw over the global batch",
                    "fix": "draw in training_step from a generator seeded with (seed, step), for the global batch, "
                           "and keep this rank's rows: vae_ddp.fixes.global_batch_draw under GlobalBatchRandomness "
                           "(see the collate_fn question page)"})
    return out
