"""Fix for data order and sampling: every optimizer step sees the single-device batch.

Default behaviour (Lightning 2.x): a single device iterates a shuffled ``RandomSampler``;
under ``strategy="ddp"`` Lightning replaces it with ``DistributedSampler(shuffle=True,
seed=int(os.environ["PL_GLOBAL_SEED"]))`` (``pytorch_lightning.trainer.connectors.
data_connector._get_distributed_sampler``), whose own permutation is dealt to the ranks
interleaved (``indices[rank::world_size]``) and padded with repeated samples up to a
multiple of the world size. The sample sets of step k then differ from the single run's.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, Sampler

from vae_ddp.fixes import _env
from vae_ddp.fixes.factor import (
    Audit, Factor, Finding, FixParts, Seen, Switch, batch_tensors, gather_objects, loader_list, samplers,
    world)

__all__ = ["GlobalBatchDistributedSampler", "GlobalBatchChunks", "StreamChunks", "deal_global_batches",
           "first_batch_shared", "FACTOR"]


class GlobalBatchDistributedSampler(DistributedSampler):
    """Deals each global batch of one shared permutation to the ranks in contiguous chunks.

    With ``num_replicas=1`` it yields the permutation in order, so the single-device
    batch k is ``perm[k*B:(k+1)*B]``; with world size N, rank r's batch k is the r-th
    chunk of ``B/N`` samples of that same global batch. The union over ranks of step k's
    batches is therefore exactly the single-device batch k, in the same order, for any N.
    Incomplete last global batches are dropped (an uneven last batch would weight samples
    differently, see the mean-reduction page).

    Use it with ``DataLoader(dataset, batch_size=global_batch_size // world_size,
    sampler=...)`` and ``Trainer(use_distributed_sampler=False)`` (Lightning would keep a
    ``DistributedSampler`` subclass anyway; the flag makes the intent explicit).
    Lightning calls `set_epoch` at every epoch, which reshuffles.

    The seed follows Lightning's own distributed sampler: without ``seed`` it is the
    ``PL_GLOBAL_SEED`` that ``seed_everything`` exported when the sampler is built (0 if
    unset), so two runs seeded differently shuffle differently. Without a process group
    (one device, a notebook) it is one replica of rank 0 unless told otherwise.

    Args:
        dataset: map-style dataset of length ``n``.
        global_batch_size: samples per optimizer step over all ranks (``B``).
        num_replicas: world size ``N``; default: from the process group, 1 without one.
        rank: this process's global rank; default: from the process group, 0 without one.
        shuffle: permute with ``torch.randperm(n, generator=manual_seed(seed + epoch))``;
            else keep dataset order.
        seed: base seed of the permutation (must be the same on every rank); default:
            ``int(os.environ["PL_GLOBAL_SEED"])``, else 0.

    Raises:
        ValueError: ``global_batch_size`` not divisible by ``num_replicas``, larger than
            the dataset, or a ``rank`` outside ``[0, num_replicas)``; ``PL_GLOBAL_SEED``
            not an integer.
    """

    def __init__(self, dataset: Dataset, global_batch_size: int, num_replicas: Optional[int] = None,
                 rank: Optional[int] = None, shuffle: bool = True, seed: Optional[int] = None) -> None:
        world, this_rank = _env.world_size(num_replicas), _env.rank(rank)
        if num_replicas is not None and rank is None and world > 1 and not _env._initialized():
            raise ValueError(f"num_replicas={num_replicas} without a process group needs rank= as well")
        super().__init__(dataset, num_replicas=world, rank=this_rank, shuffle=shuffle,
                         seed=_env.global_seed(seed), drop_last=True)
        if global_batch_size % self.num_replicas:
            raise ValueError(f"global batch size {global_batch_size} is not divisible by world size "
                             f"{self.num_replicas}: choose a multiple of {self.num_replicas}")
        if global_batch_size > len(dataset):
            raise ValueError(f"global batch size {global_batch_size} exceeds the dataset size {len(dataset)}")
        self.global_batch_size = global_batch_size
        self.per_device_batch_size = global_batch_size // self.num_replicas
        self.num_global_batches = len(dataset) // global_batch_size
        self.num_samples = self.num_global_batches * self.per_device_batch_size
        self.total_size = self.num_global_batches * global_batch_size

    def global_order(self) -> list[int]:
        """The permutation of this epoch, shared by all ranks (the single-device order)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(len(self.dataset), generator=g).tolist()
        return list(range(len(self.dataset)))

    def __iter__(self) -> Iterator[int]:
        order, b, B = self.global_order(), self.per_device_batch_size, self.global_batch_size
        for k in range(self.num_global_batches):
            start = k * B + self.rank * b
            yield from order[start:start + b]

    def __len__(self) -> int:
        return self.num_samples


class GlobalBatchChunks(Sampler):
    """A batch sampler: the global batches one device's batch sampler draws, each dealt to the
    ranks in contiguous chunks.

    ``batch_sampler`` is the user's, at the global batch size ``B`` (any: a ``BatchSampler`` over
    a ``RandomSampler`` or a ``WeightedRandomSampler``, a length-bucketing batch sampler, with or
    without ``drop_last``). At each epoch its batches are drawn once, from torch's generator seeded
    with ``seed`` and the epoch (``torch.random.fork_rng``: the caller's generator is left as it
    was), so every rank and one device draw the same global batches; rank ``r`` of ``N`` takes the
    ``r``-th of ``N`` contiguous chunks of each. A global batch that ``divisor`` (the DDP world
    size, also for one device's reference) does not divide, such as an incomplete last batch, is
    left out: equal chunks are what DDP's average of per-rank means needs to be one device's mean.
    With ``world_size=1`` it yields each global batch whole: the one-device reference of the same draws.

    Args:
        batch_sampler: iterable of index lists (``DataLoader.batch_sampler``), ``len()`` optional.
        rank: this process's global rank; world_size: ``N``.
        seed: the draws' seed (the same on every rank).
        divisor: the DDP world size the batches are dealt to (default: ``world_size``).
    """

    def __init__(self, batch_sampler: Any, rank: int, world_size: int, seed: int = 0, divisor: int = 1) -> None:
        self.batch_sampler, self.rank, self.world_size, self.seed = batch_sampler, rank, world_size, seed
        self.divisor = max(divisor, world_size)
        self.epoch = 0

    @property
    def sampler(self) -> "GlobalBatchChunks":
        """Itself: Lightning's ``_set_sampler_epoch`` (lightning_fabric 2.x) calls ``set_epoch`` on a
        loader's ``sampler`` and its ``batch_sampler.sampler``, never on the batch sampler itself;
        without this every epoch would deal epoch 0's batches again."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Lightning calls it at every epoch (``_set_sampler_epoch``); passed on to the user's sampler."""
        self.epoch = epoch
        for s in (self.batch_sampler, getattr(self.batch_sampler, "sampler", None)):
            if callable(getattr(s, "set_epoch", None)):
                s.set_epoch(epoch)

    def global_batches(self) -> list[list[int]]:
        """This epoch's global batches, as one device draws them. A ``RandomSampler`` of its own
        generator-less kind permutes with ``torch.Generator().manual_seed(seed + epoch)``: the
        permutation Lightning's ``DistributedSampler`` deals under DDP for ``seed_everything(seed)``."""
        from torch.utils.data import RandomSampler

        inner = getattr(self.batch_sampler, "sampler", None)
        own = isinstance(inner, RandomSampler) and inner.generator is None and not inner.replacement
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 1_000_003 + self.epoch)
            if own:
                inner.generator = torch.Generator().manual_seed(self.seed + self.epoch)
            try:
                return [list(b) for b in self.batch_sampler if len(b) % self.divisor == 0]
            finally:
                if own:
                    inner.generator = None

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.global_batches():
            yield batch[_span(len(batch), self.rank, self.world_size)]

    def __len__(self) -> int:
        return len(self.global_batches())


def _span(n: int, rank: int, world_size: int) -> slice:
    """The ``rank``-th of ``world_size`` contiguous chunks of ``n`` items (``numpy.array_split``'s sizes)."""
    sizes = [n // world_size + (r < n % world_size) for r in range(world_size)]
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _chunk(batch: Any, rank: int, world_size: int) -> Any:
    """The ``rank``-th contiguous chunk of every tensor of a collated batch whose first dimension is
    the batch's (any nesting, as Lightning walks batches)."""
    from lightning_utilities.core.apply_func import apply_to_collection

    n = len(batch_tensors(batch)[0])
    part = _span(n, rank, world_size)
    return apply_to_collection(batch, torch.Tensor, lambda t: t[part] if t.dim() and len(t) == n else t)


class StreamChunks(IterableDataset):
    """An iterable dataset's global batches, dealt to the ranks: what the sampler fix does to a
    stream (a ``DataLoader`` over an ``IterableDataset`` has no sampler to replace).

    ``loader`` is the user's, at the global batch size ``B``, iterated whole in every rank.
    ``shared=True`` (every rank's stream yields the same items, a dataset that does not shard by
    rank): rank ``r`` takes the ``r``-th contiguous chunk of each global batch, so step ``k``'s
    global batch is one device's batch ``k``. ``shared=False`` (the stream shards itself by rank,
    e.g. ``datasets.distributed.split_dataset_by_node``): each global batch of the rank's shard
    is cut into ``N`` per-device batches yielded in turn, so that rank's ``k``-th batch holds the
    ``k``-th ``B/N`` items of its shard, as the user's own per-device loader would.
    Use it with ``DataLoader(StreamChunks(...), batch_size=None)``.
    """

    def __init__(self, loader: Any, rank: int, world_size: int, shared: bool, seed: int = 0, divisor: int = 1) -> None:
        self.loader, self.rank, self.world_size, self.shared, self.seed = loader, rank, world_size, shared, seed
        self.divisor = max(divisor, world_size)

    def __iter__(self) -> Iterator[Any]:
        with torch.random.fork_rng(devices=[]):  # the stream's first draws (its shuffle), as on every rank
            torch.manual_seed(self.seed)
            it = iter(self.loader)
            first = next(it, None)
        if first is None:
            return
        for batch in itertools.chain([first], it):
            if len(batch_tensors(batch)[0]) % self.divisor:
                continue  # as GlobalBatchChunks: a batch the world size does not divide is left out
            if self.shared:
                yield _chunk(batch, self.rank, self.world_size)
            else:
                yield from (_chunk(batch, r, self.world_size) for r in range(self.world_size))


def first_batch_shared(dataloader: Any) -> bool:
    """Whether every rank's ``dataloader`` yields the same first batch (a digest of its tensors,
    all-gathered over the process group; True without one): a stream that does not shard by rank."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        batch = next(iter(dataloader), None)
    return len(set(gather_objects(_digest(batch_tensors(batch) if batch is not None else [])))) == 1


def deal_global_batches(dataloader: Any, rank: int, world_size: int, seed: int = 0, divisor: int = 1) -> Any:
    """The user's training loader, built at the global batch size ``B``, dealing one device's global
    batches to the ranks in contiguous chunks, whatever its (batch) sampler draws: what `vae-ddp
    audit`'s sampler fix does, from Lightning's ``Strategy.process_dataloader`` hook, with
    ``Trainer(use_distributed_sampler=False)``.

    A map-style dataset: the same dataset, ``collate_fn`` and worker settings with a
    [`GlobalBatchChunks`][vae_ddp.fixes.sampler.GlobalBatchChunks] over the user's
    ``batch_sampler`` (its weights, bucketing and ``drop_last`` kept). An ``IterableDataset``:
    [`StreamChunks`][vae_ddp.fixes.sampler.StreamChunks], shared or sharded as the ranks' first
    batches tell ([`first_batch_shared`][vae_ddp.fixes.sampler.first_batch_shared]). A loader
    without automatic batching (``batch_size=None``) is returned as it is.

    Args:
        dataloader: a ``torch.utils.data.DataLoader`` (anything else is returned as it is).
        rank: this process's global rank; world_size: the number of ranks ``N``.
        seed: the draws' seed (the same on every rank). ``world_size=1``: one device's loader of
            the same draws (the reference).
        divisor: the DDP world size: a global batch it does not divide is left out (also on one device).
    """
    from torch.utils.data import DataLoader

    dl = dataloader
    if not isinstance(dl, DataLoader):
        return dl
    if isinstance(dl.dataset, IterableDataset):
        shared = first_batch_shared(dl) if world_size > 1 else True
        return DataLoader(StreamChunks(dl, rank, world_size, shared, seed, divisor), batch_size=None)
    if dl.batch_sampler is None:
        return dl
    return DataLoader(dl.dataset, batch_sampler=GlobalBatchChunks(dl.batch_sampler, rank, world_size, seed, divisor),
                      collate_fn=dl.collate_fn, num_workers=dl.num_workers, pin_memory=dl.pin_memory,
                      worker_init_fn=dl.worker_init_fn, generator=dl.generator,
                      multiprocessing_context=dl.multiprocessing_context,
                      persistent_workers=dl.persistent_workers)


# --- the factor: its exposure check, what its fix adds, and what DDPAudit watches ----------------

def uses_global_sampler(datamodule: Any) -> bool:
    """Whether a datamodule of this project deals global batches (its ``sampler`` is ``"global"``)."""
    return getattr(datamodule, "sampler", None) == "global"


def _check(trainer, module, datamodule) -> Optional[str]:
    if world(trainer) > 1 and not uses_global_sampler(datamodule):
        return ("Lightning's DistributedSampler deals its own permutation to the ranks interleaved: the global "
                "batch of step k is not one device's batch k; use GlobalBatchDistributedSampler")
    return None


def _parts(spec, seed: int) -> FixParts:
    return FixParts(trainer={"use_distributed_sampler": False}, datamodule={"sampler": spec.sampler})


def _audit_parts(run) -> FixParts:
    # every rank deals itself its chunk of the global batches the user's loader draws at the global
    # batch size (the audit's strategy builds that loader: ``global_batch_loader``)
    def loader(dataloader, strategy):
        return deal_global_batches(strategy.global_batch_loader(), strategy.global_rank, run.devices, run.seed,
                                   divisor=run.dealt_to)

    return FixParts(trainer={"use_distributed_sampler": False}, loaders=[loader])


def _watch_loaders(seen: Seen) -> list:
    """``train_start``: a loader whose batch is not its ``GlobalBatchDistributedSampler``'s
    per-device batch; a shuffling ``DistributedSampler`` (interleaved rows of its own permutation)."""
    out = []
    for dl in loader_list(seen.trainer.train_dataloader):
        found = samplers(dl)
        s = found[0] if found else None
        per_device, bs = getattr(s, "per_device_batch_size", None), getattr(dl, "batch_size", None)
        if per_device is not None and bs is not None and bs != per_device:
            out.append(Finding(
                "sampler", f"DataLoader(batch_size={bs}) over {type(s).__name__}(global_batch_size="
                f"{s.global_batch_size}) on {s.num_replicas} ranks: each rank takes {bs} samples per step, a "
                f"global batch of {bs * s.num_replicas}, not {s.global_batch_size}",
                f"DataLoader(dataset, batch_size=sampler.per_device_batch_size, sampler=sampler), here "
                f"batch_size={per_device}", details={"mechanism": "another model"}))
    for s in samplers(seen.trainer.train_dataloader):
        if not isinstance(s, DistributedSampler) or isinstance(s, GlobalBatchDistributedSampler) or not s.shuffle:
            continue  # unshuffled: dataset order interleaved, the union of step k's batches is one device's batch k
        out.append(Finding(
            "sampler", f"{type(s).__name__}(shuffle=True) deals interleaved rows (indices[rank::{s.num_replicas}]) "
            "of its own permutation, not the one-device order (Lightning 2.x shuffles the training "
            "DistributedSampler even for DataLoader(shuffle=False))",
            "Trainer(use_distributed_sampler=False) and a sampler of your own that deals each single-device "
            "global batch to the ranks in contiguous chunks; vae_ddp.fixes.GlobalBatchDistributedSampler"))
        break
    return out


#: training batches whose shapes ``DDPAudit`` compares across the ranks (one all-gather each)
SHAPE_BATCHES = 8


def _digest(tensors: list) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _watch_shapes(seen: Seen) -> list:
    """``train_batch_start`` (the first ``SHAPE_BATCHES`` batches): at the first, did every rank
    receive the same batch (a stream every rank iterates whole)? And do the ranks' batches have
    the same shapes beyond the batch dimension? A ``collate_fn`` that pads to the longest row
    of its batch (Hugging Face's ``DataCollatorWithPadding``, ``pad_sequence``) pads each
    per-device batch to its own length under DDP, one device the global batch to one length:
    the rank's batch is then not its chunk of the one-device batch, and draws made for the
    global batch (dropout masks) or anything computed per position differ."""
    st = seen.state
    st["batches"] = st.get("batches", 0) + 1
    if st.get("found") or st["batches"] > SHAPE_BATCHES:
        return []
    first = st["batches"] == 1
    tensors = batch_tensors(seen.batch)
    gathered = gather_objects(([tuple(t.shape[1:]) for t in tensors], _digest(tensors) if first else ""))
    shapes = [s for s, _ in gathered]
    if first and len({d for _, d in gathered}) == 1:
        return [Finding(
            "sampler", f"every rank received the same first training batch: the global batch is one per-device "
                       f"batch {len(gathered)} times (a DataLoader over an IterableDataset that every rank iterates "
                       "whole, not sharded by rank)",
            "shard the stream by rank: skip to every world_size-th item from the global rank in the dataset's "
            "__iter__ (torch.distributed.get_rank(), with torch.utils.data.get_worker_info() for workers), or "
            "datasets.distributed.split_dataset_by_node for a Hugging Face dataset",
            details={"mechanism": "another model"})]
    if len({tuple(s) for s in shapes}) < 2:
        return []
    st["found"] = True
    shown = "; ".join(f"rank {r}: " + ", ".join("(b, " + ", ".join(map(str, s)) + ")" for s in ts[:2])
                      for r, ts in enumerate(shapes[:4]))
    return [Finding(
        "sampler", f"the ranks' batches differ in shape beyond the batch dimension at training batch {st['batches']} "
        f"({shown}): the collate_fn pads each per-device batch to its own longest row, one device the global batch "
        "to one length, so a rank's batch is not its chunk of the one-device batch and draws made for the global "
        "batch (dropout masks) follow other shapes",
        "pad every batch to one length L, at least the longest row: tokenizer(..., padding='max_length', "
        "max_length=L), a Hugging Face collator's pad_to_multiple_of=L, or a collate_fn that pads to L", manual=True,
        details={"mechanism": "another model"})]


FACTOR = Factor(
    position=3, key="sampler", name="Sampler and data order", page="factors/sampler.md",
    changes="datamodule sampler GlobalBatchDistributedSampler; Trainer(use_distributed_sampler=False)",
    check=_check,
    switch=Switch("sampler", default="default", fixed="global", choices=("global",), parts=_parts,
                  off_label="sampler back to DistributedSampler"),
    audit=Audit(mechanism="same distribution", parts=_audit_parts,
                watch={"train_start": _watch_loaders, "train_batch_start": _watch_shapes},
                clean="no shuffling DistributedSampler"))
