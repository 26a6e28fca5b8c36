"""Where a fix learns the run's seed, world size and rank (no process group needed).

Private helpers shared by the fixes: a fix built outside a process group (one device,
a notebook, a unit test) behaves as rank 0 of a world of size 1 instead of raising
torch's "Default process group has not been initialized".
"""

from __future__ import annotations

import os
from typing import Optional

import torch.distributed as dist

__all__ = ["global_seed", "world_size", "rank"]


def global_seed(seed: Optional[int] = None) -> int:
    """``seed`` if given, else the seed ``seed_everything`` exported as ``PL_GLOBAL_SEED``
    (``lightning_fabric.utilities.seed.seed_everything`` sets it; Lightning 2.x's
    ``_get_distributed_sampler`` reads it the same way), else 0.

    Raises:
        ValueError: ``PL_GLOBAL_SEED`` is set but is not an integer.
    """
    if seed is not None:
        return int(seed)
    env = os.environ.get("PL_GLOBAL_SEED")
    if env is None:
        return 0
    try:
        return int(env)
    except ValueError:
        raise ValueError(f"PL_GLOBAL_SEED={env!r} is not an integer: call seed_everything(<int>) or unset it") from None


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(num_replicas: Optional[int] = None) -> int:
    """``num_replicas`` if given, else the default process group's world size, else 1."""
    if num_replicas is not None:
        return int(num_replicas)
    return dist.get_world_size() if _initialized() else 1


def rank(rank_: Optional[int] = None) -> int:
    """``rank_`` if given, else this process's rank in the default process group, else 0."""
    if rank_ is not None:
        return int(rank_)
    return dist.get_rank() if _initialized() else 0
