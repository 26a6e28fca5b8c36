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

__all__ = ["batch_tensors", "reduction_gap", "dataset_is_random", "collate_is_random", "static_findings"]


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor of a batch: a tensor, or any nesting of sequences, mappings (a Hugging Face
    ``BatchEncoding`` too), namedtuples and dataclasses, as Lightning walks batches
    (``lightning_utilities.apply_to_collection``), in their order."""
    from lightning_utilities.core.apply_func import apply_to_collection

    out: list[torch.Tensor] = []
    apply_to_collection(batch, torch.Tensor, out.append)
    return out


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
    if not model.automatic_optimization:
        return None
    model = model.double()
    was_training = model.training
    model.eval()
    try:
        batch = _cast(batch, torch.float64)
        full = _grad(model, batch)
        parts = torch.stack([_grad(model, c) for c in _chunk(batch, n)]).mean(0)
    finally:
        model.train(was_training)
        model.zero_grad(set_to_none=True)
    scale = float(full.abs().max())
    return float((full - parts).abs().max()) / scale if scale > 0 else 0.0


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
    gaps = [g for g in (reduction_gap(model, b, n) for b in batches) if g is not None]
    gap = max(gaps) if gaps else None
    if gap is not None and gap > REDUCTION_TOLERANCE:
        out.append({"factor": "reduction", "fixable": False, "page": "factors/reduction.md",
                    "evidence": f"the loss is not a mean over samples: the gradient of the global batch differs from "
                                f"the mean of its {n} per-rank chunks' gradients by {gap:.3g} (relative), e.g. a mean "
                                "over a variable number of tokens per rank",
                    "fix": "average over the global item count: all-reduce the number of items (tokens, pixels, "
                           "boxes) and divide the summed loss by it (times the world size, as DDP averages); "
                           "vae_ddp.fixes.global_token_cross_entropy(logits, targets) for tokens, "
                           "vae_ddp.fixes.global_item_mean(summed_loss, item_count) for any per-item loss"})
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
