"""Random augmentation drawn in a map-style dataset's ``__getitem__``: measured, not assumed.

A dataset that draws its augmentation from torch's (or numpy's, or ``random``'s) global generator
draws it in the DataLoader's worker (or, without workers, in the rank's own process), in the order
the worker reads its samples. Whether the ranks draw the same numbers depends on how the workers are
seeded: torch seeds worker ``w`` with ``base_seed + w``, ``base_seed`` drawn from the rank's own
generator when the loader's iterator starts, and ``seed_everything(seed)`` gives every rank the same
generator, so every rank's worker ``w`` draws the same numbers; a ``worker_init_fn`` that seeds by
rank and worker (what Lightning adds, ``pl_worker_init_function(worker_id, rank)``, to a loader
without one after ``seed_everything(seed, workers=True)``: a seed sequence of the base seed, the
worker id and the global rank, for torch, ``random`` and numpy) makes the ranks' draws independent.

Two parts, as for the other draws no fix keys to a sample ([`vae_ddp.audit.draws`][vae_ddp.audit.draws]):

- [`measure`][vae_ddp.audit.loader_draws.measure], in the DDP run with Lightning's defaults: every
  rank reads the same first samples through a copy of its own training loader (its dataset,
  workers, ``worker_init_fn``, start method and generator) and the ranks compare what they drew;
- [`KeyedItems`][vae_ddp.audit.loader_draws.KeyedItems], in the compared runs only: each sample's
  draws keyed to its index, so that one device and DDP read the same augmented sample and the rest
  of the step is judged against rounding.

[`verdict`][vae_ddp.audit.loader_draws.verdict] words the measurement. This module imports no
Lightning: a loader's workers unpickle ``KeyedItems`` from it.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

__all__ = ["KeyedItems", "keyed_items", "measure", "verdict", "PROBE_SAMPLES"]

#: how many samples every rank reads alike in the probe, and through at most how many of its workers
#: (worker w of every rank against worker w of the others: a loader's workers are seeded one way)
PROBE_SAMPLES, PROBE_WORKERS = 8, 2


class KeyedItems(Dataset):
    """``dataset[i]`` with torch's, numpy's and ``random``'s generators seeded by ``(seed, i)`` for the
    read and restored afterwards: sample ``i`` draws the same augmentation wherever it is read (a
    rank's worker, one device's, the main process), every time it is read.

    Args:
        dataset: a map-style dataset. seed: the audit run's seed (the same in every compared run).
    """

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: Any) -> Any:
        key = (self.seed * 1_000_003 + int(i) * 7919 + 17) % 2**63
        np_state, py_state = np.random.get_state(), random.getstate()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(key)
            np.random.seed(key % 2**32)
            random.seed(key)
            try:
                return self.dataset[i]
            finally:
                np.random.set_state(np_state)
                random.setstate(py_state)


def keyed_items(dataloader: Any, seed: int) -> Any:
    """``dataloader`` (a ``DataLoader`` over a map-style dataset, else returned as it is) reading
    through [`KeyedItems`][vae_ddp.audit.loader_draws.KeyedItems]. Its sampler, batch sampler,
    collate function and worker settings are kept (the attribute is set past DataLoader's guard:
    the loader has not started an iterator yet)."""
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, (IterableDataset, KeyedItems)):
        return dataloader
    object.__setattr__(dataloader, "dataset", KeyedItems(dataloader.dataset, seed))
    return dataloader


def _digest(sample: Any) -> bytes:
    from vae_ddp.fixes.factor import batch_tensors

    h = hashlib.sha256()
    for t in batch_tensors(sample):
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.digest()


def _is_random(dataset: Any) -> bool:
    from vae_ddp.fixes.factor import batch_tensors

    with torch.random.fork_rng(devices=[]):
        a, b = batch_tensors(dataset[0]), batch_tensors(dataset[0])
    return any(not torch.equal(x, y) for x, y in zip(a, b))


def measure(loaders: Any, samples: int = PROBE_SAMPLES) -> Optional[dict]:
    """Call in every rank: the first training loader whose map-style dataset draws anew on every
    read is copied (its dataset, ``worker_init_fn``, ``multiprocessing_context`` and ``generator``,
    ``num_workers`` up to ``PROBE_WORKERS``; one sample a fetch, samples ``0 .. samples - 1`` in
    order) and read once, inside ``torch.random.fork_rng`` (the rank's generator, and the loader's
    own, are left where they were); the ranks all-gather what each sample came out as.

    Returns ``None`` when no loader draws so, else ``{"ranks", "samples", "workers" (the probe's),
    "worker_init_fn" (its name, or None), "distinct" (distinct draws among the ranks' ``ranks *
    samples``), "shared" (samples some other rank drew alike with rank 0)}``.
    """
    from vae_ddp.fixes.factor import gather_objects, loader_list

    for dl in loader_list(loaders):
        if not isinstance(dl, DataLoader) or isinstance(dl.dataset, IterableDataset) or len(dl.dataset) == 0:
            continue
        if not _is_random(dl.dataset):
            continue
        k, workers = min(samples, len(dl.dataset)), min(dl.num_workers, PROBE_WORKERS)
        probe = DataLoader(dl.dataset, batch_size=None, sampler=list(range(k)), num_workers=workers,
                           worker_init_fn=dl.worker_init_fn, generator=dl.generator,
                           multiprocessing_context=dl.multiprocessing_context if workers else None)
        own = dl.generator.get_state() if dl.generator is not None else None  # the loader's own, left too
        with torch.random.fork_rng(devices=[]):
            mine = [_digest(s) for s in probe]
        if own is not None:
            dl.generator.set_state(own)
        every = gather_objects(mine)
        fn = dl.worker_init_fn
        name = getattr(getattr(fn, "func", fn), "__name__", type(fn).__name__) if fn is not None else None
        return {"ranks": len(every), "samples": k, "workers": workers, "worker_init_fn": name,
                "distinct": len({d for rank in every for d in rank}),
                "shared": sum(any(rank[j] == every[0][j] for rank in every[1:]) for j in range(k))}
    return None


def verdict(measured: Optional[dict]) -> dict:
    """The words for a [`measure`][vae_ddp.audit.loader_draws.measure] result: ``{"repeated": True |
    False | None, "state": str, "short": str, "fix": str}``: ``repeated`` when any sample came out
    alike on two ranks (the same draws on every rank: another model), False when every draw is
    distinct (independent draws from one device's distribution), None where nothing was measured
    (no DDP run read the loader so): the draws are then named as unmeasured, with the same fixes."""
    keyed = ("draw each sample's augmentation from generators seeded with (seed, epoch, index), one device's "
             "draws whatever the world size: vae_ddp.fixes.SeededAugmentation(dataset, transform)")
    if measured is None:
        return {"repeated": None, "short": "not measured",
                "state": "whether the ranks draw alike was not measured (no DDP run read the dataset so)",
                "fix": "seed the DataLoader's workers by rank and worker: seed_everything(seed, workers=True); or "
                       + keyed}
    n, k, w = measured["ranks"], measured["samples"], measured["workers"]
    where = f"{w} DataLoader worker{'s' if w != 1 else ''} per rank" if w else "each rank's own process (num_workers=0)"
    seeded = f", seeded by its worker_init_fn {measured['worker_init_fn']}" if measured["worker_init_fn"] else ""
    short = f"measured: {measured['distinct']} distinct draws of {n * k} for the same {k} samples on {n} ranks"
    counted = (f"measured: the same {k} samples read on each of the {n} ranks, in {where}{seeded}, came out as "
               f"{measured['distinct']} distinct draws of {n * k}")
    if not measured["shared"]:
        return {"repeated": False, "short": short,
                "fix": "none needed; for one device's very draws whatever the world size, " + keyed,
                "state": f"the ranks draw independent augmentations ({counted}): independent draws from one "
                         "device's distribution, as Lightning's DistributedSampler takes other samples of it"}
    if w:
        fix = ("seed the workers by rank and worker: seed_everything(seed, workers=True), with which Lightning "
               "gives a loader without a worker_init_fn its pl_worker_init_function (a seed sequence of the base "
               "seed, the worker id and the global rank for torch, numpy and random), or a worker_init_fn of "
               "your own that does so (the audit's runs call seed_everything(seed): pass the worker_init_fn to "
               "the DataLoader to have it measured); or ")
        why = ("the workers' generators are seeded alike on every rank (torch seeds worker w with base_seed + w, "
               "base_seed drawn from the rank's generator, which seed_everything(seed) seeds alike)")
    else:
        fix = "seed each rank's generator differently (torch.manual_seed(seed + self.global_rank) in setup); or "
        why = "the ranks' generators are seeded alike (seed_everything(seed) on every rank)"
    return {"repeated": True, "short": short, "fix": fix + keyed,
            "state": f"every rank's loader draws the same augmentation as rank 0's for the sample it reads at the "
                     f"same place ({counted}; {measured['shared']} of the {k} alike on two ranks): {why}"}
