"""Fix for data order and sampling: every optimizer step sees the single-device batch.

Default behaviour (Lightning 2.x): a single device iterates a shuffled ``RandomSampler``;
under ``strategy="ddp"`` Lightning replaces it with ``DistributedSampler(shuffle=True,
seed=int(os.environ["PL_GLOBAL_SEED"]))`` (``pytorch_lightning.trainer.connectors.
data_connector._get_distributed_sampler``), whose own permutation is dealt to the ranks
interleaved (``indices[rank::world_size]``) and padded with repeated samples up to a
multiple of the world size. The sample sets of step k then differ from the single run's.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from torch.utils.data import Dataset, DistributedSampler

from vae_ddp.fixes import _env
from vae_ddp.fixes.factor import Factor, Finding, FixParts, Seen, batch_tensors, gather_objects, loader_list, samplers, world

__all__ = ["GlobalBatchDistributedSampler", "deal_global_batches", "FACTOR"]


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


def deal_global_batches(dataloader: Any, global_batch_size: int, rank: int, world_size: int, seed: int = 0) -> Any:
    """The same loader dealing one device's global batches to the ranks in contiguous chunks: a
    ``DataLoader`` over the same dataset, ``collate_fn`` and worker settings with a
    [`GlobalBatchDistributedSampler`][vae_ddp.fixes.sampler.GlobalBatchDistributedSampler]
    (shuffled when the original loader shuffles, i.e. has a ``RandomSampler``; else in dataset
    order) and the per-device batch size ``global_batch_size // world_size``. An incomplete last
    global batch is dropped. What `vae-ddp audit` does to a user's training loader, from
    Lightning's ``Strategy.process_dataloader`` hook; with ``Trainer(use_distributed_sampler=False)``
    so that Lightning keeps this sampler.

    Args:
        dataloader: a ``torch.utils.data.DataLoader`` (anything else is returned as it is).
        global_batch_size: samples per optimizer step over all ranks; divisible by ``world_size``.
        rank: this process's global rank; world_size: the number of ranks.
        seed: the shuffle's seed (the same on every rank).
    """
    from torch.utils.data import DataLoader, RandomSampler

    dl = dataloader
    if not isinstance(dl, DataLoader):
        return dl
    sampler = GlobalBatchDistributedSampler(dl.dataset, global_batch_size, num_replicas=world_size, rank=rank,
                                            seed=seed, shuffle=isinstance(dl.sampler, RandomSampler))
    return DataLoader(dl.dataset, batch_size=global_batch_size // world_size, sampler=sampler,
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
    def loader(dataloader, strategy):
        return deal_global_batches(dataloader, run.global_batch_size, strategy.global_rank, run.devices, run.seed)

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
                f"batch_size={per_device}"))
    for s in samplers(seen.trainer.train_dataloader):
        if not isinstance(s, DistributedSampler) or isinstance(s, GlobalBatchDistributedSampler) or not s.shuffle:
            continue  # unshuffled: dataset order interleaved, the union of step k's batches is one device's batch k
        out.append(Finding(
            "sampler", f"{type(s).__name__}(shuffle=True) deals interleaved rows (indices[rank::{s.num_replicas}]) "
            "of its own permutation, not the one-device order (Lightning 2.x shuffles the training "
            "DistributedSampler even for DataLoader(shuffle=False))",
            "deal each single-device global batch to the ranks in contiguous chunks with "
            "Trainer(use_distributed_sampler=False) and a sampler of your own; "
            "vae_ddp.fixes.GlobalBatchDistributedSampler"))
        break
    return out


#: training batches whose shapes ``DDPAudit`` compares across the ranks (one all-gather each)
SHAPE_BATCHES = 8


def _watch_shapes(seen: Seen) -> list:
    """``train_batch_start`` (the first ``SHAPE_BATCHES`` batches): do the ranks' batches have
    the same shapes beyond the batch dimension? A ``collate_fn`` that pads to the longest row
    of its batch (Hugging Face's ``DataCollatorWithPadding``, ``pad_sequence``) pads each
    per-device batch to its own length under DDP, one device the global batch to one length:
    the rank's batch is then not its chunk of the one-device batch, and draws made for the
    global batch (dropout masks) or anything computed per position differ."""
    st = seen.state
    st["batches"] = st.get("batches", 0) + 1
    if st.get("found") or st["batches"] > SHAPE_BATCHES:
        return []
    shapes = gather_objects([tuple(t.shape[1:]) for t in batch_tensors(seen.batch)])
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
        "max_length=L), a Hugging Face collator's pad_to_multiple_of=L, or a collate_fn that pads to L", manual=True)]


FACTOR = Factor(
    key="sampler", name="Sampler and data order", page="factors/sampler.md",
    changes="datamodule sampler GlobalBatchDistributedSampler; Trainer(use_distributed_sampler=False)",
    check=_check, field="sampler", default="default", fixed="global", choices=("global",),
    parts=_parts, audit_parts=_audit_parts, off_label="sampler back to DistributedSampler",
    watch={"train_start": _watch_loaders, "train_batch_start": _watch_shapes},
    clean="no shuffling DistributedSampler")
