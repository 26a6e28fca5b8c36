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
from typing import Any, Iterable, Optional

import numpy as np
import torch
from pytorch_lightning import Callback, LightningModule, Trainer

from vae_ddp.fixes.dropout import SWAPPABLE
from vae_ddp.fixes.factor import (
    Audit, Factor, Finding, FixParts, Seen, Switch, batch_tensors, gather_digest, rng_states, world)
from vae_ddp.fixes.randomness import GlobalBatchRandomness

__all__ = ["PerRankSeed", "GlobalBatchNoise", "dataset_is_random", "collate_is_random", "FACTOR"]


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


# --- the factor: its exposure check, what its fix adds, and what DDPAudit watches ----------------

#: torch's optimizers that scale each parameter's step by a running statistic of its gradient.
ADAPTIVE = tuple(getattr(torch.optim, name) for name in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad",
                                                         "Adadelta", "RMSprop", "SparseAdam")
                 if hasattr(torch.optim, name))

#: the per-parameter state of those statistics in torch's optimizers (a third-party optimizer that
#: keeps one under these names is counted too, once it has stepped)
ADAPTIVE_STATE = ("exp_avg_sq", "square_avg", "exp_inf", "acc_delta", "sum")


def adaptive(optimizers: Iterable[Any]) -> list[str]:
    """The class names of the ``optimizers`` with per-parameter step sizes: one of ``ADAPTIVE``, or
    one whose state holds a statistic of ``ADAPTIVE_STATE``; an empty list for SGD."""
    out = []
    for opt in optimizers:
        opt = getattr(opt, "optimizer", opt)  # a LightningOptimizer wraps the user's
        state = getattr(opt, "state", {}) or {}
        if isinstance(opt, ADAPTIVE) or any(k in s for s in state.values() if isinstance(s, dict)
                                            for k in ADAPTIVE_STATE):
            out.append(type(opt).__name__)
    return list(dict.fromkeys(out))


def _check(trainer, module, datamodule) -> Optional[str]:
    n = world(trainer)
    if n > 1 and not any(isinstance(cb, (PerRankSeed, GlobalBatchRandomness)) for cb in trainer.callbacks):
        return (f"{n} ranks seeded alike draw the same random numbers in training_step (reparameterization "
                f"noise, dropout masks): add GlobalBatchRandomness (GlobalBatchNoise for the VAE) or PerRankSeed")
    return None


def _parts(spec, seed: int) -> FixParts:
    return FixParts(callbacks=[{"per_rank": PerRankSeed, "global": GlobalBatchNoise}[spec.noise](seed)])


def _audit_parts(run) -> FixParts:
    # dropout and drop-path layers, a `noise` attribute: drawn for the global batch
    return FixParts(callbacks=[GlobalBatchRandomness(run.seed)])


def _idle(trainer: Trainer, module: LightningModule) -> bool:
    """``GlobalBatchRandomness`` changes a run only through what draws from its stream (the layers it swaps,
    the ``noise`` it serves, ``global_batch_draw``) and the epoch it gives a ``SeededAugmentation``: idle
    where it swapped no layer, the run drew nothing from it and its loaders hold no ``SeededAugmentation``."""
    fix = next((c for c in trainer.callbacks if isinstance(c, GlobalBatchRandomness)), None)
    return fix is not None and not fix.swapped and fix.drawn == 0 and not fix.augmentations


def _watch_streams(seen: Seen) -> list:
    """``train_start``: the same next draws on every rank? (the hash of 16 draws from a forked
    generator, all-gathered); skipped under ``PerRankSeed``. Under ``GlobalBatchRandomness`` the
    generators are still alike: a draw from them in the step is one the fix does not serve (it
    serves dropout layers and a ``noise`` attribute)."""
    module, st = seen.module, seen.state
    st["shared"] = False
    st["served"] = any(isinstance(cb, GlobalBatchRandomness) for cb in seen.trainer.callbacks)
    if any(isinstance(cb, PerRankSeed) for cb in seen.trainer.callbacks) and not st["served"]:
        return []
    devices = [module.device] if module.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        draw = torch.rand(16, device=module.device, dtype=torch.float64)
    st["shared"] = len(set(gather_digest(draw.cpu().numpy().tobytes()))) == 1
    return []


def _watch_before(seen: Seen) -> list:
    """``train_batch_start`` (the first batch's): the generators' states before the step."""
    if seen.state.get("shared") and "before" not in seen.state:
        seen.state["before"] = rng_states(seen.module)
    return []


def _watch_draws(seen: Seen) -> list:
    """``train_batch_end`` (first batch): did the step draw from the shared global generator?"""
    before, n = seen.state.get("before"), world(seen.trainer)
    if not seen.state.get("shared") or before is None:
        return []
    if all(torch.equal(a, b) for a, b in zip(before, rng_states(seen.module))):
        return []  # the training step draws no random numbers from torch's global generator
    if seen.state["served"]:
        return [Finding(
            "noise", f"the training step draws random numbers from torch's global generator that "
            "GlobalBatchRandomness does not serve (it serves nn.Dropout layers and a `noise` attribute): "
            f"all {n} ranks draw the same ones, not this rank's share of the global batch's "
            "(torch.randn in training_step, drop-path, dropout inside scaled_dot_product_attention, ...)",
            "draw them for the global batch and keep this rank's rows: "
            "x = vae_ddp.fixes.global_batch_draw(torch.randn, shape) (under GlobalBatchRandomness), "
            "or swap the layer for one that does", manual=True)]

    found = [Finding(
        "noise", f"the training step draws random numbers and all {n} ranks draw the same "
        "ones (same torch seed): its dropout masks or noise repeat across ranks",
        "draw the randomness of the global batch and keep this rank's rows (a torch.Generator seeded "
        "alike on every rank), or seed each rank differently (torch.manual_seed(seed + rank) in "
        "setup); vae_ddp.fixes.GlobalBatchRandomness (dropout and noise) / PerRankSeed")]
    names = adaptive(seen.trainer.optimizers)  # SGD has no per-parameter step sizes: nothing follows
    if names:
        found.append(Finding(
            "optimizer", "shared noise across ranks raises the variance of the averaged gradient, which "
            f"changes {', '.join(names)}'s per-parameter step sizes (its running second moments)",
            "the noise fix above"))
    return found


def dataset_is_random(dm: Any) -> bool:
    """Two reads of sample 0 of the training set differ (random augmentation in ``__getitem__``)."""
    ds = dm.train_dataloader().dataset
    if len(ds) == 0:
        return False
    with torch.random.fork_rng():
        a, b = ds[0], ds[0]
    ta, tb = batch_tensors(a), batch_tensors(b)
    return any(not torch.equal(x, y) for x, y in zip(ta, tb))


def collate_is_random(dm: Any, samples: int = 4) -> bool:
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


#: what the one-process checks say of random draws in the loader: (evidence, fix)
_LOADER_DRAWS = {
    "dataset": ("the dataset draws random augmentation in __getitem__ (two reads of a sample differ): a draw per "
                "sample that depends on the world size and on which process reads it (the audit measures whether "
                "the ranks draw alike: vae_ddp.audit.loader_draws)",
                "draw each sample's augmentation from generators seeded with (seed, epoch, index): "
                "vae_ddp.fixes.SeededAugmentation(dataset, transform)"),
    "collate_fn": ("the DataLoader's collate_fn draws random numbers (e.g. batch-level mixup): every rank draws the "
                   "same ones (the same seed), and a draw over the per-device batch is not the one-device draw over "
                   "the global batch",
                   "draw in training_step from a generator seeded with (seed, step), for the global batch, and keep "
                   "this rank's rows: vae_ddp.fixes.global_batch_draw under GlobalBatchRandomness (see the "
                   "collate_fn question page)"),
}


def _before(model: Any, datamodule: Any, batches: list, n: int) -> list[Finding]:
    """The one-process checks of `vae-ddp audit`: random draws in the dataset and in the loader's ``collate_fn``."""
    seen = [where for where, is_random in (("dataset", dataset_is_random), ("collate_fn", collate_is_random))
            if is_random(datamodule)]
    return [Finding(FACTOR.key, *_LOADER_DRAWS[where], manual=True, details={"loader_draws": where}) for where in seen]


FACTOR = Factor(
    position=1, key="noise", name="Random streams per rank", page="factors/noise.md",
    changes="Trainer callback GlobalBatchNoise (global-batch noise, sliced by rank) or PerRankSeed (seed + rank)",
    check=_check,
    switch=Switch("noise", default="default", fixed="global", choices=("per_rank", "global"), parts=_parts,
                  off_label="noise back to default"),
    audit=Audit(parts=_audit_parts, before=_before, clean="no training-step draws repeated across ranks", idle=_idle,
                watch={"train_start": _watch_streams, "train_batch_start": _watch_before,
                       "train_batch_end": _watch_draws}))
