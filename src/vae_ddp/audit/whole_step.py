"""The whole step, judged: besides the gradient, what DDP's step leaves in the model on every rank.

Every teacher-forced step starts from one device's state θ_k (parameters and buffers); the
gradient is not all a step changes. [`StepProbe`][vae_ddp.probes.StepProbe] also records, per
training batch, the update it applied (θ_(k+1) - θ_k: the learning rate and the optimizer's state
count), what the forward wrote into the buffers, the learning rate of each optimizer step, and
under DDP how far the ranks' parameters are apart at its end. This module compares DDP's record
(rank 0's, and every rank against rank 0's) with one device's, against the same comparison for
one device with the samples of each batch permuted (the floor), and names what differs first:

- ``learning rate``: the rate an optimizer step applies differs (a schedule computed from the
  per-device loader's length, a rate scaled by the world size);
- ``update``: the same gradient and rate, another update (the optimizer's state or arguments);
- ``buffers``: a forward that writes per-rank values into buffers (moving averages of the local
  batch: a codebook, a normaliser); DDP broadcasts rank 0's buffers before each forward
  (``DistributedDataParallel(broadcast_buffers=True)``, PyTorch 2.x), so the model keeps what
  rank 0's share of the batch wrote;
- ``ranks``: the ranks' parameters apart after the step (a forward that writes to parameters in
  place on each rank, such as ``nn.Embedding(max_norm=...)``, PyTorch's ``embedding_renorm_``);
  DDP synchronises parameters only once, when it wraps the module.

A difference counts when it is more than ``FLOOR_RATIO`` times the larger of the floor (the
largest permuted draw, relative to one device's change) and one rounding of every stored value
(``eps * ||θ||``: a float32 parameter is stored to 24 bits, which a last-bit different gradient
can flip): ``ratio = ||a - b|| / max(floor * ||b - θ_k||, eps * ||θ_(k+1)||)``.
"""

from __future__ import annotations

import math
from typing import Optional

from torch import Tensor

from vae_ddp.probes import relative_difference
from vae_ddp.studies.equivalence import FLOOR_FACTOR

__all__ = ["PARTS", "compare", "scaled_by_world_size", "LR_TOLERANCE"]

#: The parts of a step in the order the audit names them when several differ at the same step.
PARTS = ("gradient", "learning rate", "update", "buffers", "ranks")

#: Learning rates are computed by the same arithmetic on every rank and on one device: any
#: relative difference above this is another schedule, not rounding.
LR_TOLERANCE = 1e-9


def compare(ddp: dict, single: dict, floors: list[dict], eps: float, unit: float = 0.0) -> dict:
    """Compare the whole step of DDP's record with one device's.

    Args:
        ddp: [`StepProbe.record()`][vae_ddp.probes.StepProbe.record] of DDP's rank 0 (every fix
            on, every step from one device's weights): ``updates``, ``buffer_updates``, ``norms``,
            ``lrs``, ``ranks_apart`` (and ``ranks_apart_names``), ``param_names``, ``buffer_names``.
        single: the one-device reference's record (the same keys; no ``ranks_apart``).
        floors: the records of one device with the samples of each batch permuted.
        eps: the machine epsilon of the parameters' dtype.
        unit: the least relative floor: one rounding unit of the dtype the step computes in (under
            ``bf16-mixed``, bfloat16's ``eps``, where a permuted batch can give exactly the same
            gradient while DDP differs by a quarter of that unit); 0 for a step in the parameters' dtype.

    Returns:
        ``{"update_steps", "buffer_steps", "ranks_apart_steps"}`` (per training batch, the ratio
        defined above), ``"update_floor"``, ``"buffer_floor"`` (relative), ``"lr_steps"``
        (per optimizer step, the largest relative difference of a parameter group's rate),
        ``"update_ratio"``, ``"buffer_ratio"``, ``"ranks_ratio"`` (the largest), ``"buffer_count"``
        (the floating-point buffers' elements), and
        ``"differences"``: per part that differs, the first batch where it does, ``{"part",
        "step", "ratio", "detail", "names"}``, in the order of ``PARTS`` within a step.

    Raises:
        ValueError: records of different lengths (the runs did not take the same steps).
    """
    n = len(single["updates"])
    if len(ddp["updates"]) != n or any(len(f["updates"]) != n for f in floors):
        raise ValueError(f"{len(ddp['updates'])} training batches compared with one device's {n}")
    update_floor = max(_floor(floors, single, "updates"), unit)
    buffer_floor = max(_floor(floors, single, "buffer_updates"), unit)
    scale = [float(s.norm()) for s in single["updates"]]
    updates = [_ratio(a, b, update_floor, eps * norm[0])
               for a, b, norm in zip(ddp["updates"], single["updates"], single["norms"])]
    buffers = [_ratio(a, b, buffer_floor, eps * norm[1])
               for a, b, norm in zip(ddp["buffer_updates"], single["buffer_updates"], single["norms"])]
    ranks = [_ratio_of_distance(d, update_floor * s, eps * norm[0])
             for d, s, norm in zip(ddp.get("ranks_apart") or [0.0] * n, scale, single["norms"])]
    lr_steps = [max((abs(a - b) / abs(b) if b else float(a != b) for a, b in zip(da, sa)), default=0.0)
                for da, sa in zip(ddp["lrs"], single["lrs"])]
    differences = []
    first_lr = next((i for i, d in enumerate(lr_steps) if d > LR_TOLERANCE), None)
    if first_lr is not None:
        batch = single["grad_batches"][first_lr] if first_lr < len(single.get("grad_batches", [])) else first_lr
        differences.append({"part": "learning rate", "step": batch,
                            "ratio": _lr_ratio(ddp["lrs"][first_lr], single["lrs"][first_lr]),
                            "detail": {"ddp": ddp["lrs"][first_lr], "single": single["lrs"][first_lr],
                                       "optimizer_step": first_lr},
                            "names": []})
    for part, steps, key, names in (("update", updates, "updates", "param_names"),
                                    ("buffers", buffers, "buffer_updates", "buffer_names")):
        k = next((i for i, r in enumerate(steps) if r > FLOOR_FACTOR), None)
        if k is not None:
            differences.append({"part": part, "step": k, "ratio": steps[k], "detail": {},
                                "names": _largest(ddp[key][k] - single[key][k], ddp[names])})
    k = next((i for i, r in enumerate(ranks) if r > FLOOR_FACTOR), None)
    if k is not None:
        differences.append({"part": "ranks", "step": k, "ratio": ranks[k], "detail": {},
                            "names": [{"name": m, "max_abs_diff": v, "module": o}
                                      for m, v, o in ddp["ranks_apart_names"][k]]})
    differences.sort(key=lambda d: (d["step"], PARTS.index(d["part"])))
    return {"update_steps": updates, "buffer_steps": buffers, "ranks_apart_steps": ranks, "lr_steps": lr_steps,
            "update_floor": update_floor, "buffer_floor": buffer_floor,
            "update_ratio": max(updates, default=0.0), "buffer_ratio": max(buffers, default=0.0),
            "ranks_ratio": max(ranks, default=0.0), "buffer_count": sum(int(k) for _, k in single["buffer_names"]),
            "differences": differences}


def scaled_by_world_size(ddp_grads: list[Tensor], single_grads: list[Tensor], world_size: int,
                         tolerance: float = 1e-3) -> Optional[float]:
    """The factor (``1/N`` or ``N``) when every step's DDP gradient is one device's times it
    (``g_ddp = s * g_single`` with ``|s * N - 1|`` or ``|s / N - 1|`` and the residual
    ``||g_ddp - s g_single|| / ||g_single||`` within ``tolerance``): a loss or gradient scaled by
    the world size (``loss / self.trainer.world_size``, while DDP already averages over the
    ranks); None otherwise. ``*_grads``: one flat float64 vector ``(P,)`` per optimizer step."""
    factors = []
    for a, b in zip(ddp_grads, single_grads):
        a, b = a.double(), b.double()
        nb = float(b @ b)
        if nb == 0:
            continue
        s = float(a @ b) / nb
        if relative_difference(a, s * b) > tolerance:
            return None
        factors.append(s)
    for target in (1.0 / world_size, float(world_size)):
        if factors and world_size > 1 and all(abs(s / target - 1) <= tolerance for s in factors):
            return target
    return None


def _floor(floors: list[dict], single: dict, key: str) -> float:
    """The largest finite relative difference of any floor draw's ``key`` from one device's."""
    values = [relative_difference(a, b) for f in floors for a, b in zip(f[key], single[key]) if b.numel()]
    return max((v for v in values if math.isfinite(v)), default=0.0)


def _ratio(a: Tensor, b: Tensor, floor: float, rounding: float) -> float:
    """``||a - b|| / max(floor * ||b||, rounding)`` (0.0 for equal or empty vectors)."""
    if not b.numel():
        return 0.0
    return _ratio_of_distance(float((a.double() - b.double()).norm()), floor * float(b.norm()), rounding)


def _ratio_of_distance(distance: float, floor: float, rounding: float) -> float:
    if distance == 0:
        return 0.0
    yardstick = max(floor, rounding)
    return distance / yardstick if yardstick > 0 else float("inf")


def _lr_ratio(ddp: list[float], single: list[float]) -> float:
    """DDP's rate over one device's, in the parameter group where they differ most."""
    pairs = [(a, b) for a, b in zip(ddp, single) if a != b]
    a, b = max(pairs, key=lambda p: abs(p[0] - p[1]) / max(abs(p[1]), 1e-300))
    return a / b if b else float("inf")


def _largest(diff: Tensor, names: list[list], n: int = 3) -> list[dict]:
    """The ``n`` named entries of a flat vector with the largest absolute values."""
    sizes = [int(k) for _, k in names]
    if not sizes or sum(sizes) != diff.numel():
        return []
    per = [(float(d.abs().max()) if d.numel() else 0.0, name) for d, (name, _) in zip(diff.split(sizes), names)]
    return [{"name": name, "max_abs_diff": v} for v, name in sorted(per, reverse=True)[:n] if v > 0]
