"""What a launch needs before it starts: memory for its ranks and space for what they write.

[`launch`][vae_ddp.harness.launch.launch] refuses a run that does not fit with one line
(a [`UserError`][vae_ddp.errors.UserError]) before any process starts.
"""

from __future__ import annotations

from typing import Optional

from vae_ddp.errors import UserError
from vae_ddp.harness.configs import RunSpec

__all__ = ["check_memory", "audit_cost", "space_needed", "NotEnoughMemory", "RANK_BYTES", "LOG_BYTES"]


class NotEnoughMemory(UserError):
    """The processes of a launch would need more memory than the machine has available (bad input:
    too large a world size)."""


#: Memory of one rank beside its model's tensors, in bytes: 67 processes of a ``--devices 64``
#: compare took 8.2 GB of free memory (18.3 GB before, 10.1 GB during its first step), 122 MB each.
RANK_BYTES = 150 * 10 ** 6


def _available_memory() -> Optional[int]:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _param_bytes(s) -> int:
    """Bytes of the parameters of a [`RunSpec`][vae_ddp.harness.configs.RunSpec]'s model (counted
    on torch's ``meta`` device); 0 for another kind of spec."""
    if not isinstance(s, RunSpec):
        return 0
    import torch

    from vae_ddp.model import VAE

    with torch.device("meta"):
        model = VAE(input_height=32, enc_type=s.model, latent_dim=s.latent_dim or 32)
    return sum(p.numel() for p in model.parameters()) * (8 if s.dtype == "float64" else 4)


def check_memory(spec) -> None:
    """Refuse a launch whose ranks would not fit in memory: per rank ``RANK_BYTES`` and six times
    its model's parameters (weights, gradients, Adam's two moments, DDP's gradient buckets, a
    copy), for the widest group of ``spec``, against ``MemAvailable``. (On a machine without
    ``/proc/meminfo`` nothing is checked.)

    Raises:
        NotEnoughMemory: the estimate is more than is available (the message gives both).
    """
    from vae_ddp.outputs import megabytes

    available = _available_memory()
    if available is None or spec.accelerator != "cpu":
        return
    widest = max(_specs(spec), key=lambda s: s.world_size)
    per_rank = RANK_BYTES + 6 * max(_param_bytes(s) for s in _specs(spec))
    needed = widest.world_size * per_rank
    if needed > available:
        fits = max(1, available // per_rank)
        raise NotEnoughMemory(f"{widest.world_size} processes need about {megabytes(needed)} of memory "
                              f"({megabytes(per_rank)} each), {megabytes(available)} is available: use at most "
                              f"{fits} processes (fewer --devices)")


def audit_cost(devices: int, param_bytes: int = 0) -> str:
    """What ``vae-ddp audit --devices N`` will cost, in one line for its output: its processes (N DDP
    ranks and the one-device runs' process beside them), the CPU cores they share and the memory
    they need (``RANK_BYTES`` and six times ``param_bytes``, the model's parameters in bytes, each).

    Raises:
        NotEnoughMemory: (before any process starts) the estimate is more than ``MemAvailable``
            (the message gives both and how many processes fit); nothing is checked on a machine
            without ``/proc/meminfo``.
    """
    import os

    from vae_ddp.outputs import megabytes

    processes, per_process = devices + 1, RANK_BYTES + 6 * param_bytes
    needed, available, cores = processes * per_process, _available_memory(), os.cpu_count() or 1
    if available is not None and needed > available:
        fits = max(1, available // per_process)
        raise NotEnoughMemory(f"--devices {devices}: {processes} processes ({devices} DDP ranks and the one-device "
                              f"runs beside them) need about {megabytes(needed)} of memory ({megabytes(per_process)} "
                              f"each), {megabytes(available)} is available: use at most --devices {max(1, fits - 1)}")
    share = f", about {devices / cores:.3g}x as long per step as with a core each" if devices > cores else ""
    return (f"{processes} processes ({devices} DDP ranks and the one-device runs beside them) on {cores} CPU "
            f"core{'s' * (cores != 1)}{share}; about {megabytes(needed)} of memory ({megabytes(per_process)} each)"
            + (f", {megabytes(available)} available" if available is not None else ""))


#: Bytes of logs, ``run.json`` files and figures a launch writes beside its tensors (at most).
LOG_BYTES = 2 * 2 ** 20


def _specs(spec) -> list:
    """The specs of a launch: a job's (``.specs``), else the one spec."""
    return list(spec.specs) if hasattr(spec, "specs") else [spec]


def space_needed(spec) -> int:
    """Bytes a launch of ``spec`` (a [`Job`][vae_ddp.harness.launch.Job] or one
    [`RunSpec`][vae_ddp.harness.configs.RunSpec]) writes at most: ``LOG_BYTES``, and per seed of each spec that saves them its
    parameters with Adam's second moments (2 x parameters), and its per-step gradients and
    weights (3 x parameters x steps). The parameters are counted on a model built on torch's
    ``meta`` device (no memory, milliseconds); a spec of another kind (the audit's runs) counts
    ``LOG_BYTES`` only."""
    total = LOG_BYTES
    for s in _specs(spec):
        if not isinstance(s, RunSpec) or not (s.save_params or s.steps_file):
            continue
        size = _param_bytes(s)
        total += len(s.seeds) * size * ((2 if s.save_params else 0) + (3 * s.steps if s.steps_file else 0))
    return total
