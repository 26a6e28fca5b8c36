"""What a launch needs before it starts: memory for its ranks and space for what they write.

[`launch`][vae_ddp.harness.launch.launch] refuses a run that does not fit with one line
(a [`UserError`][vae_ddp.errors.UserError]) before any process starts. A spec says what its
model weighs: ``param_bytes()``, the bytes of its parameters, and ``saved_bytes()``, the bytes
of the tensors it writes at most (a [`RunSpec`][vae_ddp.harness.configs.RunSpec] has both; an audit's
[`AuditRun`][vae_ddp.audit.spec.AuditRun] the latter, from the parameter count its pre-flight took); a
spec without them counts none. This module knows no model: the audit, which
launches through it, imports nothing of the VAE study (``tests/test_layers.py``).
"""

from __future__ import annotations

from typing import Optional

from vae_ddp.errors import UserError

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
    """Bytes of the parameters of a spec's model: its ``param_bytes()`` (a
    [`RunSpec`][vae_ddp.harness.configs.RunSpec]'s, counted on torch's ``meta`` device); 0 for a
    spec without one."""
    return s.param_bytes() if hasattr(s, "param_bytes") else 0


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


#: Bytes of logs, ``run.json`` files and figures a study's launch writes beside its tensors (at most): a
#: ``vae-ddp compare --configs '[single, ddp]' --steps 2`` wrote 282 kB of them (250 kB its two figures).
LOG_BYTES = 2 * 2 ** 20


def _specs(spec) -> list:
    """The specs of a launch: a job's (``.specs``), else the one spec."""
    return list(spec.specs) if hasattr(spec, "specs") else [spec]


def space_needed(spec) -> int:
    """Bytes a launch of ``spec`` (a [`Job`][vae_ddp.harness.launch.Job] or one spec) writes at
    most: the logs (a spec's ``log_bytes``, else ``LOG_BYTES``), and each spec's ``saved_bytes()`` (a
    [`RunSpec`][vae_ddp.harness.configs.RunSpec]'s: per seed, its parameters with Adam's second
    moments, and its per-step gradients and weights; an audit's run,
    [`AuditRun.saved_bytes`][vae_ddp.audit.spec.AuditRun.saved_bytes]); a spec without ``saved_bytes``
    counts the logs only."""
    specs = _specs(spec)
    logs = max(getattr(s, "log_bytes", LOG_BYTES) for s in specs)
    return logs + sum(s.saved_bytes() for s in specs if hasattr(s, "saved_bytes"))
