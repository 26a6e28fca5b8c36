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

A floor is what rounding does, and only where it is rounding is it a floor (:func:`valid_floor`).
The gradient and the update are the same mathematics for any order of the rows, so their
permuted floors are rounding (the update's carried through the optimizer: Adam divides each
element by its own size, measured 1.8e-9 relative in float64 where the gradient's is 3.7e-16);
the audit judges nothing when the gradient's is not (``vae_ddp.audit.study``). A buffer is
written by the step, possibly in the order of the rows: one whose permuted floor is above both
``ROUNDING_EPS`` machine epsilons and what rounding does to the gradient and the update (a queue
of keys written in the order of the rows: 0.96 relative on ``examples/audit_models.py:KeyQueue``,
against 8.5e-16 for the update) is judged against that rounding instead, since DDP with the
sampler fix deals one device's rows in one device's order. Integer buffers (a queue's pointer, a
counter) are compared exactly, and the ranks' buffers after the step against rank 0's.
"""

from __future__ import annotations

import math
from typing import Optional

from torch import Tensor

from vae_ddp.probes import relative_difference
from vae_ddp.harness.permutation import FLOOR_FACTOR

__all__ = ["PARTS", "compare", "scaled_by_world_size", "valid_floor", "trajectory", "explain_buffers",
           "LR_TOLERANCE", "ROUNDING_EPS"]

#: The parts of a step in the order the audit names them when several differ at the same step.
PARTS = ("gradient", "learning rate", "update", "buffers", "ranks")

#: Learning rates are computed by the same arithmetic on every rank and on one device: any
#: relative difference above this is another schedule, not rounding.
LR_TOLERANCE = 1e-9

#: A floor is rounding when it is at most this many machine epsilons of the dtype (or 10 rounding
#: units of an autocast dtype): the audit's threshold (``vae_ddp.audit.study.ROUNDING_EPS``, the same value).
ROUNDING_EPS = 1e4


def valid_floor(floor: float, eps: float, unit: float = 0.0, rounding: float = 0.0) -> bool:
    """Whether a measured floor (relative) is rounding, and so a floor at all: at most
    ``ROUNDING_EPS`` machine epsilons ``eps`` of the stored dtype, 10 of the autocast dtype's
    rounding ``unit``, or ``rounding``, what rounding measurably does to the same step's
    order-free parts (the gradient's and the update's permuted floors). Above all of them the
    permuted draws changed the state by more than rounding does (it depends on the order of the
    batch's rows), and nothing may pass against it."""
    return floor <= max(ROUNDING_EPS * eps, 10 * unit, rounding)


def compare(ddp: dict, single: dict, floors: list[dict], eps: float, unit: float = 0.0) -> dict:
    """Compare the whole step of DDP's record with one device's.

    Args:
        ddp: [`StepProbe.record()`][vae_ddp.probes.StepProbe.record] of DDP's rank 0 (every fix
            on, every step from one device's weights): ``updates``, ``buffer_updates``, ``norms``,
            ``lrs``, ``ranks_apart`` (and ``ranks_apart_names``), ``param_names``, ``buffer_names``,
            and where recorded ``grads``, ``int_buffers`` (``int_buffer_names``), ``buffers_apart``.
        single: the one-device reference's record (the same keys; no ``ranks_apart``).
        floors: the records of one device with the samples of each batch permuted.
        eps: the machine epsilon of the parameters' dtype.
        unit: the least relative floor: one rounding unit of the dtype the step computes in (under
            ``bf16-mixed``, bfloat16's ``eps``, where a permuted batch can give exactly the same
            gradient while DDP differs by a quarter of that unit); 0 for a step in the parameters' dtype.

    Returns:
        ``{"update_steps", "buffer_steps", "ranks_apart_steps"}`` (per training batch, the ratio
        defined above; a buffer's against the floor valid for it), ``"update_floor"``,
        ``"buffer_floor"`` (relative: the largest permuted floor of the buffers that are judged by
        theirs), ``"rounding_floor"`` (relative: the larger of the gradient's and the update's
        permuted floors, what the buffers of ``"order_buffers"`` are judged by), ``"order_buffers"``
        (``{name: permuted floor}`` of the buffers whose permuted floor is not rounding, see
        :func:`valid_floor`), ``"lr_steps"`` (per optimizer step, the largest relative difference
        of a parameter group's rate), ``"update_ratio"``, ``"buffer_ratio"``, ``"ranks_ratio"`` (the
        largest), ``"buffer_count"`` (the floating-point buffers' elements), and
        ``"differences"``: per part that differs, the first batch where it does, ``{"part",
        "step", "ratio", "detail", "names"}``, in the order of ``PARTS`` within a step; the
        ``buffers`` part's ``detail``: ``{"integers": [[name, ddp, single], ...]`` (integer buffers
        that differ, exactly), ``"ranks": [[name, max_abs_diff, max_abs_value], ...]`` (buffers
        whose ranks differ by more than 2 roundings), ``"order"`` (the ``order_buffers``' names),
        ``"gradient_ratio"`` (the gradient's difference over its floor at that batch, or None)}``.

    Raises:
        ValueError: records of different lengths (the runs did not take the same steps).
    """
    n = len(single["updates"])
    if len(ddp["updates"]) != n or any(len(f["updates"]) != n for f in floors):
        raise ValueError(f"{len(ddp['updates'])} training batches compared with one device's {n}")
    fl = _step_floors(single, floors, eps, unit)
    per = _per_batch(ddp, single, fl, eps, unit)
    updates, buffers, ranks = per["updates"], per["buffers"], per["ranks"]
    return {"update_steps": updates, "buffer_steps": buffers, "ranks_apart_steps": ranks, "lr_steps": per["lr_steps"],
            "update_floor": fl["update_floor"], "buffer_floor": fl["buffer_floor"], "rounding_floor": fl["rounding"],
            "order_buffers": fl["moved"],
            "update_ratio": max(updates, default=0.0), "buffer_ratio": max(buffers, default=0.0),
            "ranks_ratio": max(ranks, default=0.0), "buffer_count": sum(int(k) for _, k in single["buffer_names"]),
            "differences": _differences(ddp, single, per, sorted(fl["moved"]))}


def _step_floors(single: dict, floors: list[dict], eps: float, unit: float) -> dict:
    """The floors of [`compare`][vae_ddp.audit.whole_step.compare] (relative, floats): ``update_floor``,
    ``grad_floor``, ``rounding`` (the larger of the two), ``moved`` (``{buffer name: permuted floor}`` of the
    buffers whose permuted floor is not rounding), ``buffer_floor`` (the others' largest, at least ``unit``)
    and ``per_element`` (each buffer element's floor, ``_element_floors``)."""
    update_floor = max(_floor(floors, single, "updates"), unit)
    # what rounding does to this step's order-free parts: the gradient, and the update through the optimizer
    grad_floor = _floor(floors, single, "grads") if "grads" in single else 0.0
    rounding = max(grad_floor, update_floor)
    # each buffer against a floor valid for it: its own permuted draws where they are rounding, else the
    # step's rounding (a state written in the order of the rows, compared without the permutation)
    buffer_floors = _named_floors(floors, single, "buffer_updates", single["buffer_names"])
    moved = {name: f for name, f in buffer_floors.items() if not valid_floor(f, eps, unit, rounding)}
    kept = [f for name, f in buffer_floors.items() if name not in moved]
    buffer_floor = max(max(kept, default=0.0), unit)
    per_element = _element_floors(single["buffer_names"], buffer_floors, moved, buffer_floor, rounding)
    return {"update_floor": update_floor, "grad_floor": grad_floor, "rounding": rounding, "moved": moved,
            "buffer_floor": buffer_floor, "per_element": per_element}


def _per_batch(ddp: dict, single: dict, fl: dict, eps: float, unit: float) -> dict:
    """Per training batch (``lr_steps``: per optimizer step), DDP's step against one device's, each part
    against its floor of ``fl`` (``_step_floors``): ``updates``,
    ``buffers``, ``ranks`` and ``grads`` (ratios to the floor, floats), ``integers`` (the integer buffers
    that differ) and ``apart`` (the buffers whose ranks differ), lists of ``[name, ...]`` rows."""
    n = len(single["updates"])
    update_floor, grad_floor = fl["update_floor"], fl["grad_floor"]
    scale = [float(s.norm()) for s in single["updates"]]
    updates = [_ratio(a, b, update_floor, eps * norm[0])
               for a, b, norm in zip(ddp["updates"], single["updates"], single["norms"])]
    buffers = [_ratio_elementwise(a, b, fl["per_element"], eps * norm[1])
               for a, b, norm in zip(ddp["buffer_updates"], single["buffer_updates"], single["norms"])]
    int_names = single.get("int_buffer_names") or []
    integers = [_integers_differ(a, b, int_names)
                for a, b in zip(ddp.get("int_buffers") or [None] * n, single.get("int_buffers") or [None] * n)]
    float_names = {name for name, _ in single["buffer_names"]}
    apart = [[[name, d, v] for name, d, v in step
              if (name not in float_names and d > 0) or d > FLOOR_FACTOR * max(eps, unit) * max(v, 1e-300)]
             for step in (ddp.get("buffers_apart") or [[] for _ in range(n)])]
    # the gradient against its floor as the audit's verdict takes it (never below one machine epsilon)
    grads = ([_ratio(a, b, max(grad_floor, unit, eps), 0.0) for a, b in zip(ddp["grads"], single["grads"])]
             if "grads" in ddp and "grads" in single and len(ddp["grads"]) == len(single["grads"]) else [])
    ranks = [_ratio_of_distance(d, update_floor * s, eps * norm[0])
             for d, s, norm in zip(ddp.get("ranks_apart") or [0.0] * n, scale, single["norms"])]
    lr_steps = [max((abs(a - b) / abs(b) if b else float(a != b) for a, b in zip(da, sa)), default=0.0)
                for da, sa in zip(ddp["lrs"], single["lrs"])]
    return {"updates": updates, "buffers": buffers, "integers": integers, "apart": apart, "grads": grads,
            "ranks": ranks, "lr_steps": lr_steps}


def _differences(ddp: dict, single: dict, per: dict, order: list[str]) -> list[dict]:
    """[`compare`][vae_ddp.audit.whole_step.compare]'s ``differences`` from the ratios of ``per``
    (``_per_batch``); ``order``: the names of the buffers judged by
    the step's rounding."""
    n = len(single["updates"])
    updates, buffers, ranks, lr_steps = per["updates"], per["buffers"], per["ranks"], per["lr_steps"]
    integers, apart, grads = per["integers"], per["apart"], per["grads"]
    differences = []
    first_lr = next((i for i, d in enumerate(lr_steps) if d > LR_TOLERANCE), None)
    if first_lr is not None:
        batch = single["grad_batches"][first_lr] if first_lr < len(single.get("grad_batches", [])) else first_lr
        differences.append({"part": "learning rate", "step": batch,
                            "ratio": _lr_ratio(ddp["lrs"][first_lr], single["lrs"][first_lr]),
                            "detail": {"ddp": ddp["lrs"][first_lr], "single": single["lrs"][first_lr],
                                       "optimizer_step": first_lr},
                            "names": []})
    k = next((i for i, r in enumerate(updates) if r > FLOOR_FACTOR), None)
    if k is not None:
        differences.append({"part": "update", "step": k, "ratio": updates[k], "detail": {},
                            "names": _largest(ddp["updates"][k] - single["updates"][k], ddp["param_names"])})
    k = next((i for i in range(n) if buffers[i] > FLOOR_FACTOR or integers[i] or apart[i]), None)
    if k is not None:
        gradient_ratio = next((grads[j] for j, b in enumerate(single.get("grad_batches") or range(len(grads)))
                               if b == k and j < len(grads)), None)
        differences.append({"part": "buffers", "step": k, "ratio": buffers[k],
                            "detail": {"integers": integers[k], "ranks": apart[k],
                                       "order": order, "gradient_ratio": gradient_ratio},
                            "names": _largest(ddp["buffer_updates"][k] - single["buffer_updates"][k],
                                              ddp["buffer_names"])})
    k = next((i for i, r in enumerate(ranks) if r > FLOOR_FACTOR), None)
    if k is not None:
        differences.append({"part": "ranks", "step": k, "ratio": ranks[k], "detail": {},
                            "names": [{"name": m, "max_abs_diff": v, "module": o}
                                      for m, v, o in ddp["ranks_apart_names"][k]]})
    differences.sort(key=lambda d: (d["step"], PARTS.index(d["part"])))
    return differences


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


def _named_floors(floors: list[dict], single: dict, key: str, names: list[list]) -> dict:
    """Per named entry of the flat vectors ``key`` (``names``: ``[[name, numel], ...]``), the largest
    finite relative difference of any floor draw's from one device's, over the steps; one entry,
    ``"*"``, when the vectors do not split by the names (a sketch)."""
    sizes = [int(k) for _, k in names]
    whole = all(sum(sizes) == b.numel() for b in single[key])
    out: dict = {}
    for f in floors:
        for a, b in zip(f[key], single[key]):
            if not b.numel():
                continue
            parts = zip(a.split(sizes), b.split(sizes), (m for m, _ in names)) if whole else [(a, b, "*")]
            for x, y, name in parts:
                v = relative_difference(x, y) if y.numel() else 0.0
                if math.isfinite(v):
                    out[name] = max(out.get(name, 0.0), v)
    return out


def _element_floors(names: list[list], floors: dict, moved: dict, kept_floor: float, rounding: float):
    """Per element of the buffers' vector, the relative floor it is judged by: ``rounding`` for a
    buffer whose permuted floor is not rounding (``moved``), else ``kept_floor``; a float when all
    are the same (``"*"``: the vector does not split by the names)."""
    if not moved:
        return kept_floor
    if "*" in moved:
        return rounding
    return [(rounding if name in moved else kept_floor, int(k)) for name, k in names]


def _ratio_elementwise(a: Tensor, b: Tensor, floor, rounding: float) -> float:
    """:func:`_ratio` with ``floor`` per named part (``[(floor, numel), ...]``): the largest over the parts."""
    if not isinstance(floor, list) or sum(k for _, k in floor) != b.numel():
        return _ratio(a, b, floor if not isinstance(floor, list) else min(f for f, _ in floor), rounding)
    sizes = [k for _, k in floor]
    return max((_ratio(x, y, f, rounding) for x, y, (f, _) in zip(a.split(sizes), b.split(sizes), floor)), default=0.0)


def _integers_differ(a: Optional[Tensor], b: Optional[Tensor], names: list[list]) -> list[list]:
    """The integer buffers whose values differ (compared exactly): ``[[name, ddp, single], ...]``
    with the first differing element of each."""
    if a is None or b is None or not b.numel() or a.shape != b.shape:
        return []
    out = []
    for x, y, (name, _) in zip(a.split([int(k) for _, k in names]), b.split([int(k) for _, k in names]), names):
        i = (x != y).nonzero()
        if len(i):
            out.append([name, int(x[i[0, 0]]), int(y[i[0, 0]])])
    return out


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


def trajectory(single: dict, permuted: dict, fixed: dict, buffer_names: list[str], unit: float,
               order: tuple = ()) -> dict:
    """The free-running steps, each kind of state against a floor valid for it: the parameters apart
    from the buffers (a queue that a permutation rewrites would otherwise set the floor of both, and
    hide the parameters' drift), each ``||fixed - single||_max / max(||permuted - single||_max,
    unit * ||single||_max)``; the buffers of ``order`` (those a permutation moves by more than
    rounding in one step, see :func:`compare`) are left out, judged step by step instead.

    Args:
        single: the saved final state ``{name: Tensor}`` (floating-point parameters and buffers) of
            one device.
        permuted: the same, of one device with the samples permuted.
        fixed: the same, of DDP with every fix.
        buffer_names: which names of the states are buffers.
        unit: the rounding unit of the dtype the step computes in.
        order: buffers left out.

    Returns:
        ``{"ratio", "floor", "divergence", "unit", "kind", "left_out"}``: the larger ratio of the
        two kinds (``kind``: ``"parameters"`` or ``"buffers"``) with that kind's floor, difference
        and rounding unit of its largest value; ``left_out``: the buffers of ``order`` in the states.
    """
    buffers = set(buffer_names)
    best = None
    for kind, names in (("parameters", [k for k in single if k not in buffers]),
                        ("buffers", [k for k in single if k in buffers and k not in order])):
        if not names:
            continue
        floor, divergence = (max(float((a[k].double() - single[k].double()).abs().max()) for k in names)
                             for a in (permuted, fixed))
        rounding = unit * max((float(single[k].double().abs().max()) for k in names if single[k].numel()), default=0.0)
        yardstick = max(floor, rounding)
        ratio = divergence / yardstick if yardstick > 0 else (0.0 if divergence == 0 else float("inf"))
        if best is None or ratio > best["ratio"]:
            best = {"ratio": ratio, "floor": floor, "divergence": divergence, "unit": rounding, "kind": kind}
    best = best or {"ratio": 0.0, "floor": 0.0, "divergence": 0.0, "unit": 0.0, "kind": "parameters"}
    return dict(best, left_out=sorted(k for k in single if k in order))


def explain_buffers(d: dict, after: str) -> dict:
    """Evidence and fix of the ``buffers`` part of :func:`compare`'s ``differences`` (``after``: when,
    in words): the floating-point buffers that differ most, the integer buffers that differ (exact),
    the buffers whose ranks hold other values, and the gradient beside them when it differs too."""
    detail = d.get("detail") or {}
    order, integers, ranks = detail.get("order") or [], detail.get("integers") or [], detail.get("ranks") or []
    names = ", ".join(f"{x['name']} ({x['max_abs_diff']:.3g})" for x in d["names"])
    parts = []
    if names:
        parts.append(f"{d['ratio']:.3g}x the floor {after}; largest in {names}")
    if integers:
        parts.append("integer buffers differ (compared exactly): " + ", ".join(
            f"{name} {a} under DDP vs {b} on one device" for name, a, b in integers))
    if ranks:
        parts.append("the ranks' buffers differ after the step: "
                     + ", ".join(f"{name} ({v:.3g})" for name, v, _ in ranks))
    evidence = "the step writes per-rank values into buffers: " + "; ".join(parts) + (
        ". DDP broadcasts rank 0's buffers before each forward, so the model keeps what rank 0's share of the batch "
        "wrote")
    if order:
        evidence += (f"; {', '.join(order)} depends on the order of the batch's rows "
                     "(a permuted batch moves it by more "
                     "than rounding), so it is compared with one device's rows in one device's order, to rounding")
    g = detail.get("gradient_ratio")
    if g is not None and g > FLOOR_FACTOR:
        evidence += (f"; the gradient differs too at that step ({g:.3g}x its floor), from the same weights and buffers "
                     "(rerun the audit after the fix to see what is left)")
    written = {x["name"] for x in d["names"]} | {x[0] for x in integers} | {x[0] for x in ranks}
    if written & set(order):
        fix = ("gather every rank's rows before writing them (keys = self.all_gather(keys).flatten(0, 1), as MoCo's "
               "concat_all_gather does) so that every rank writes the global batch's rows, in one device's order, and "
               "advances its pointer by the global batch")
    else:
        fix = ("compute the buffers' update over the global batch: all-reduce the sums and counts "
               "(torch.distributed.all_reduce) before writing them, as torch.nn.SyncBatchNorm does")
    return {"evidence": evidence, "fix": fix}
