"""Random augmentation keyed by sample and epoch: the same on any world size, with any workers.

A random transform in a ``Dataset`` draws from the default generator of the process that
runs ``__getitem__``: the DDP rank itself, or one of its DataLoader workers, which torch
seeds with ``base_seed + worker_id`` where ``base_seed`` comes from the rank's generator.
After ``seed_everything(seed)`` the ranks' generators are identical, so rank 0 and rank 1
augment their different samples with the same random parameters, and no world size (or
number of workers) augments sample ``i`` as one device does. (``seed_everything(seed,
workers=True)`` makes Lightning seed workers per rank as well, which makes ranks differ but
still ties the draws to the world size and the worker layout.)

[`SeededAugmentation`][vae_ddp.fixes.augmentation.SeededAugmentation] runs the transform of
sample ``i`` at epoch ``e`` under generators seeded from ``(seed, e, i)`` only (torch's CPU
generator, ``random`` and ``numpy``, forked and restored around the call), so any transform
that draws from them (torchvision's, hand-written ``torch.rand`` calls) gives sample ``i``
the same augmentation on any world size, rank, worker count and worker.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from vae_ddp.fixes import _env

__all__ = ["SeededAugmentation", "sample_seed", "seeded_generators", "set_augmentation_epoch"]


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed that depends only on ``(seed, epoch, index)``, well mixed
    (``numpy.random.SeedSequence([seed, epoch, index])``; all three must be >= 0)."""
    hi, lo = np.random.SeedSequence([seed, epoch, index]).generate_state(2, dtype=np.uint32)
    return ((int(hi) << 32) | int(lo)) & (2**63 - 1)


@contextmanager
def seeded_generators(seed: int) -> Iterator[None]:
    """Seed torch's CPU generator, ``random`` and ``numpy``'s global state with ``seed`` for
    the duration of the block, then put all three back as they were (so the caller's own
    stream, e.g. a DataLoader worker's, is not moved). CUDA generators are not touched."""
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


class SeededAugmentation(Dataset):
    """Wrap a map-style dataset: apply ``transform`` to a sample under generators seeded
    from ``(seed, epoch, index)``.

    ``dataset[index]`` is read, then ``transform`` is applied to element ``item`` of it (a
    tuple/list sample such as ``(x, y)``, or a key of a dict sample) or, with ``item=None``,
    to the whole sample, inside [`seeded_generators`][vae_ddp.fixes.augmentation.seeded_generators]
    (``sample_seed(seed, epoch, index)``). Call [`set_epoch`][vae_ddp.fixes.augmentation.SeededAugmentation.set_epoch]
    at every epoch for new augmentations each epoch:
    [`GlobalBatchRandomness`][vae_ddp.fixes.randomness.GlobalBatchRandomness] does it in
    ``on_train_epoch_start``, before Lightning creates the epoch's DataLoader iterator (and so
    its worker processes, which receive a copy of the dataset). With
    ``persistent_workers=True`` the workers keep the epoch they started with.

    Args:
        dataset: map-style dataset.
        transform: callable on the selected element, drawing its randomness from torch's
            CPU generator, ``random`` or ``numpy.random`` (e.g. ``torchvision.transforms.v2``).
        seed: base seed; default: ``seed_everything``'s seed (``PL_GLOBAL_SEED``) read at
            each ``__getitem__``, else 0.
        item: which element of the sample to transform (``None``: the whole sample).

    Raises:
        ValueError: ``set_epoch`` with a negative epoch.
    """

    def __init__(self, dataset: Dataset, transform: Callable[[Any], Any], seed: Optional[int] = None,
                 item: Union[int, str, None] = 0) -> None:
        self.dataset, self.transform, self.seed, self.item = dataset, transform, seed, item
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Augment as at epoch ``epoch`` from now on."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        sample = self.dataset[index]
        with seeded_generators(sample_seed(_env.global_seed(self.seed), self.epoch, int(index))):
            if self.item is None:
                return self.transform(sample)
            if isinstance(sample, dict):
                return {**sample, self.item: self.transform(sample[self.item])}
            out = list(sample)
            out[self.item] = self.transform(out[self.item])  # type: ignore[index]
            return tuple(out) if isinstance(sample, tuple) else out


def set_augmentation_epoch(loaders: Any, epoch: int) -> int:
    """Call ``set_epoch(epoch)`` on every [`SeededAugmentation`][vae_ddp.fixes.augmentation.SeededAugmentation]
    reachable from ``loaders`` (a DataLoader, a Lightning ``CombinedLoader``, or a list/dict
    of them) through ``.dataset`` attributes (``Subset``, wrappers) and ``.datasets``
    (``ConcatDataset``). Returns how many it found."""
    seen: set[int] = set()
    found = 0
    stack = [(loaders, True)]  # (object, is a container of loaders)
    while stack:
        obj, container = stack.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, SeededAugmentation):
            obj.set_epoch(epoch)
            found += 1
        if container and isinstance(obj, dict):
            stack.extend((v, True) for v in obj.values())
        elif container and isinstance(obj, (list, tuple)):
            stack.extend((v, True) for v in obj)
        if hasattr(type(obj), "flattened"):  # Lightning's CombinedLoader
            stack.append((obj.flattened, True))
        if isinstance(getattr(obj, "dataset", None), Dataset):
            stack.append((obj.dataset, False))
        if isinstance(getattr(obj, "datasets", None), (list, tuple)):  # ConcatDataset
            stack.extend((d, False) for d in obj.datasets)
    return found
