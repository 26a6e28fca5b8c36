"""What is left of DDP's gradient with every fix on, localised and named (issue #48, items 3 and 8).

A difference that survives every fix the audit applies is in the user's code. The teacher-forced
runs (every step from one device's weights) give DDP's gradient and one device's at every
optimizer step; this module compares them optimizer by optimizer, each on its own parameters (a
GAN's generator and discriminator step on their own losses), parameter by parameter, as a scale
``s = <g_ddp, g_one> / <g_one, g_one>``, a cosine and a relative difference, and names three
mechanisms with the change that closes each:

- **an exact k/N**: one optimizer's gradient is one device's times ``k/N`` (cosine 1, no residual):
  that optimizer's loss is scaled by the world size (``loss / self.trainer.world_size``, while DDP
  already averages the ranks' gradients);
- **gradients never averaged**: the ranks' gradients differ when the optimizer steps (DDP's
  all-reduce leaves the same bits on every rank), and their mean is one device's: under manual
  optimisation ``loss.backward()`` instead of ``self.manual_backward(loss)`` (Lightning prepares
  DDP's reducer only there: ``DDPStrategy.pre_backward``);
- **a gather without gradient**: ``self.all_gather(t)`` called on a tensor that requires a gradient
  without ``sync_grads=True`` (seen by [`watch_gathers`][vae_ddp.audit.localise.watch_gathers] in the
  DDP run): on one device ``all_gather`` returns the tensor itself, with its gradient; under DDP the
  gathered tensor has none.

The first two are no switch the audit can turn from outside the user's code: their fix is worded as
what to change and to rerun the audit after. The third is: where such a gather was seen, the audit
trains DDP's step once more with ``sync_grads=True`` forced on those calls (``SYNC_GRADS``,
:func:`watch_gathers` with ``force``) and its fix says, measured, whether that gives one device's
gradient (:func:`sync_grads_check`). A factor whose own fix changes nothing from either end
(:func:`fix_changes_nothing`) is never the headline of what is left.
"""

from __future__ import annotations

import contextlib
import math
import traceback
from typing import Iterator, Optional

import torch
from torch import Tensor

from vae_ddp.fixes.reduction import FACTOR as _REDUCTION_FACTOR
from vae_ddp.harness.permutation import FLOOR_FACTOR

#: The factor a gather without gradient is named under (the mean reduction's: a loss coupled across ranks)
REDUCTION = _REDUCTION_FACTOR.key

__all__ = ["RANKS_GRADS", "SYNC_GRADS", "SCALE_TOLERANCE", "fix_changes_nothing", "per_optimizer", "world_fraction",
           "unreduced", "findings", "describe", "judge", "watch_gathers", "sync_grads_check"]

#: The audit's run whose ranks' gradients the probe measures (``StepProbe(ranks_grads=True)``): DDP with
#: every fix, every step from one device's weights.
RANKS_GRADS = "ddp+fixed-forced"

#: The audit's check of its ``sync_grads`` advice: ``RANKS_GRADS`` trained again with ``sync_grads=True``
#: forced on the gathers :func:`watch_gathers` saw there (run only when it saw one).
SYNC_GRADS = "ddp+fixed-forced+sync_grads"

#: A gradient is one device's times ``s`` exactly when ``||g_ddp - s g_one|| / ||g_one||`` is within this.
SCALE_TOLERANCE = 1e-3


def fix_changes_nothing(contribution: Optional[float], left: float, alone: Optional[float],
                        none: Optional[float]) -> bool:
    """Whether a factor's fix changes nothing from either end: with every other fix on, leaving its
    own off adds at most ``FLOOR_FACTOR`` times what every fix leaves (``contribution <= 2 left``:
    it cannot be told from what is left), and with its fix alone Lightning's defaults lose less than
    half their difference (``alone >= none / 2``). Such a factor does not bite, whatever the rest.
    All values are relative gradient differences (floats, None where not measured: then False)."""
    if contribution is None or alone is None or none is None:
        return False
    return contribution <= FLOOR_FACTOR * left and alone * FLOOR_FACTOR >= none


def world_fraction(scale: float, n: int, tolerance: float = SCALE_TOLERANCE) -> Optional[tuple[int, int]]:
    """``(k, n)`` when ``scale`` is ``k / n`` for a whole ``k >= 1`` other than ``n`` (within
    ``tolerance`` relative), or ``n``: a gradient scaled by the world size; None otherwise."""
    if n < 2 or scale <= 0:
        return None
    if abs(scale / n - 1) <= tolerance:
        return (n * n, n)
    k = round(scale * n)
    if 1 <= k and k != n and abs(scale * n / k - 1) <= tolerance:
        return (k, n)
    return None


def _slices(index: list[int], sizes: list[int]) -> dict[int, tuple[int, int]]:
    """Where each parameter (index into ``sizes``) sits in a gradient vector that holds ``index``."""
    out, at = {}, 0
    for i in index:
        out[i] = (at, at + sizes[i])
        at += sizes[i]
    return out


def _compare(a: Tensor, b: Tensor) -> dict:
    """``{"scale", "cosine", "relative", "residual"}`` of ``a`` against ``b`` (float64 vectors)."""
    a, b = a.double(), b.double()
    nb, na = float(b @ b), float(a.norm())
    if nb == 0:
        return {"scale": math.inf if na else 1.0, "cosine": 0.0, "relative": math.inf if na else 0.0, "residual": 0.0}
    s = float(a @ b) / nb
    return {"scale": s, "cosine": float(a @ b) / (na * math.sqrt(nb)) if na else 0.0,
            "relative": float((a - b).norm()) / math.sqrt(nb), "residual": float((a - s * b).norm()) / math.sqrt(nb)}


def per_optimizer(ddp: dict, single: dict, yardstick: float, n: int) -> list[dict]:
    """DDP's gradient against one device's, per optimizer and per parameter.

    Args:
        ddp: [`StepProbe.record()`][vae_ddp.probes.StepProbe.record] of DDP with every fix
            (rank 0, every step from one device's weights): ``grads``, ``grad_batches``,
            ``param_names`` and, where recorded, ``grad_index`` and ``opt_index`` (without them, one
            group over the whole gradient).
        single: the same record of one device.
        yardstick: the gradient's floor (relative), never below one rounding unit.
        n: the world size.

    Returns:
        One dict per optimizer, in the order they step within a batch: ``{"index": i,
        "parameters": [name, ...], "steps", "relative" (the largest relative difference),
        "scale" and "cosine" (at that step), "residual" (the largest ``||a - s b|| / ||b||``),
        "within" (``relative <= FLOOR_FACTOR * yardstick``), "fraction" (``[k, n]`` when every
        step is one device's times the same k/n exactly, else None), "largest"}``; ``largest``: the
        three parameters that differ most, ``[{"name", "relative", "scale", "cosine"}]``.
    """
    names = [m for m, _ in ddp.get("param_names") or single.get("param_names") or []]
    sizes = [int(k) for _, k in ddp.get("param_names") or single.get("param_names") or []]
    indexed = all(ddp.get(k) and single.get(k) for k in ("grad_index", "opt_index")) and names
    groups: dict[int, list] = {}
    seen: dict[int, int] = {}
    for j, (a, b) in enumerate(zip(ddp["grads"], single["grads"])):
        batch = single["grad_batches"][j] if j < len(single.get("grad_batches") or []) else j
        i = seen[batch] = seen.get(batch, -1) + 1  # the i-th optimizer step of its batch
        if indexed and ddp["grad_index"][j] == single["grad_index"][j]:
            where = _slices(single["grad_index"][j], sizes)
            own = [p for p in single["opt_index"][j] if p in where]
            parts = {names[p]: (a[slice(*where[p])], b[slice(*where[p])]) for p in own}
        else:
            parts = {"*": (a, b)}
        groups.setdefault(i, []).append(parts)
    out = []
    for i, steps in sorted(groups.items()):
        whole = [_compare(torch.cat([x for x, _ in s.values()]), torch.cat([y for _, y in s.values()]))
                 for s in steps if s]
        if not whole:
            continue
        worst = max(whole, key=lambda c: c["relative"])
        fractions = {world_fraction(c["scale"], n) for c in whole if c["residual"] <= SCALE_TOLERANCE}
        exact = len(fractions) == 1 and None not in fractions and all(c["residual"] <= SCALE_TOLERANCE for c in whole)
        per_param: dict[str, dict] = {}
        for s in steps:
            for name, (x, y) in s.items():
                c = _compare(x, y)
                if name not in per_param or c["relative"] > per_param[name]["relative"]:
                    per_param[name] = dict(c, name=name)
        largest = sorted(per_param.values(), key=lambda c: -c["relative"])[:3]
        out.append({"index": i, "parameters": [m for m in steps[0] if m != "*"], "steps": len(whole),
                    "relative": worst["relative"], "scale": worst["scale"], "cosine": worst["cosine"],
                    "residual": max(c["residual"] for c in whole),
                    "within": worst["relative"] <= FLOOR_FACTOR * yardstick,
                    "fraction": list(next(iter(fractions))) if exact else None,
                    "largest": [{k: c[k] for k in ("name", "relative", "scale", "cosine")} for c in largest]})
    return out


def unreduced(ddp: dict, single: dict, yardstick: float) -> Optional[dict]:
    """Whether DDP's ranks stepped on gradients that were never averaged: ``{"apart", "mean",
    "mean_within"}`` (the largest relative distance of a rank's gradient from rank 0's, the largest
    relative difference of the ranks' mean from one device's gradient, and whether that is within
    ``FLOOR_FACTOR * yardstick``) when the ranks' gradients are apart by more than that at some
    step (the record's ``grads_apart``, ``grads_mean``); None when they are the same or not recorded."""
    apart = [a for a in ddp.get("grads_apart") or [] if a is not None]
    if not apart or max(apart) <= FLOOR_FACTOR * yardstick:
        return None
    means = [_compare(m, g)["relative"] for m, g in zip(ddp.get("grads_mean") or [], single["grads"])
             if m is not None and m.shape == g.shape]
    mean = max(means, default=math.inf)
    return {"apart": max(apart), "mean": mean, "mean_within": mean <= FLOOR_FACTOR * yardstick}


def _optimizer_words(g: dict) -> str:
    params = ", ".join(g["parameters"][:4]) + (", ..." if len(g["parameters"]) > 4 else "")
    return f"optimizer {g['index']}" + (f" (over {params})" if params else "")


def describe(groups: list[dict], yardstick: float) -> str:
    """One clause per optimizer whose gradient differs: its scale, cosine and relative difference to
    one device's, and the parameters that differ most (the report's words for what is left)."""
    parts = []
    for g in groups:
        if g["within"]:
            parts.append(f"{_optimizer_words(g)}: one device's gradient ({g['relative'] / yardstick:.2g}x the floor)")
            continue
        top = ", ".join(f"{p['name']} ({p['relative']:.3g}, {p['scale']:.3g}x, cosine {p['cosine']:.3f})"
                        for p in g["largest"] if p["name"] != "*")
        parts.append(f"{_optimizer_words(g)}: DDP's gradient is {g['scale']:.3g}x one device's, cosine "
                     f"{g['cosine']:.3f}, {g['relative']:.3g} relative" + (f"; most in {top}" if top else ""))
    return "; ".join(parts)


def findings(groups: list[dict], reduce: Optional[dict], gathers: list[str], yardstick: float, n: int,
             checked: Optional[dict] = None) -> dict:
    """The audit's rows for the mechanisms named above, ``{factor: {"factor", "evidence", "fix",
    "manual": True, "localised": True}}``: ``parameters`` for gradients never averaged (``reduce``,
    :func:`unreduced`), ``reduction`` for a gather without gradient (``gathers``: where
    ``self.all_gather`` was called so, :func:`watch_gathers`; ``checked``: DDP's gradient with
    ``sync_grads=True`` forced there, :func:`sync_grads_check`, which its fix reports, or None where
    not measured: then the fix is worded as what to try), ``gradient_scale`` for an optimizer
    whose gradient is an exact k/N of one device's (``groups``, :func:`per_optimizer`). Empty when
    every optimizer's gradient is within the floor."""
    differ = [g for g in groups if not g["within"]]
    if not differ and reduce is None:
        return {}
    out = {}
    where = describe(groups, yardstick)
    if reduce is not None:
        mean = (f"the mean of the ranks' gradients is one device's ({reduce['mean']:.3g} relative)"
                if reduce["mean_within"] else f"the mean of the ranks' gradients differs from one device's by "
                                              f"{reduce['mean']:.3g} relative")
        out["parameters"] = {
            "factor": "parameters", "manual": True, "localised": True,
            "evidence": f"the ranks' gradients are never averaged: when the optimizer steps, a rank's gradient is "
                        f"{reduce['apart']:.3g} relative from rank 0's (DDP's all-reduce leaves the same bits on "
                        f"every rank) and {mean}; each rank steps on its own share of the batch and the ranks' "
                        f"parameters part ({where})",
            "fix": "under manual optimisation call self.manual_backward(loss), not loss.backward(): Lightning "
                   "prepares DDP's all-reduce of the gradients only in manual_backward (under automatic "
                   "optimisation return the loss and let Lightning call backward); then rerun the audit"}
    if gathers and differ:
        sites = ", ".join(gathers[:3])
        out[REDUCTION] = {
            "factor": REDUCTION, "manual": True, "localised": True,
            "evidence": f"{sites} gathers a tensor that requires a gradient with self.all_gather without "
                        "sync_grads=True: under DDP the gathered rows carry no gradient, where on one device "
                        f"all_gather returns the tensor itself with its gradient, so the loss over them is coupled "
                        f"across ranks without its gradient ({where})",
            "fix": "gather with the gradient: self.all_gather(t, sync_grads=True) " + _checked_words(checked)}
    scaled = [g for g in differ if g["fraction"]]
    if scaled and reduce is None and REDUCTION not in out:
        clauses = []
        for g in scaled:
            k, m = g["fraction"]
            what = (f"{k // m} times" if k == m * m else f"{k}/{m} of")
            clauses.append(f"{_optimizer_words(g)}'s gradient is exactly {what} one device's ({g['scale']:.4g}x, "
                           f"cosine {g['cosine']:.4f}) at every step")
        same = [g for g in groups if g["within"]]
        if same:
            clauses.append("; ".join(f"{_optimizer_words(g)}'s is one device's" for g in same))
        over = any(g["fraction"][0] < g["fraction"][1] for g in scaled)
        out["gradient_scale"] = {
            "factor": "gradient_scale", "manual": True, "localised": True,
            "evidence": "; ".join(clauses) + f": that loss is {'divided' if over else 'multiplied'} by the world "
                                              f"size ({n}) or a part of it, and otherwise the same",
            "fix": f"remove the factor from the loss of {', '.join(_optimizer_words(g) for g in scaled)} (e.g. "
                   "/ self.trainer.world_size): DDP already averages the gradients over the ranks, so the mean loss "
                   "of the per-device batch gives one device's gradient of the global batch; then rerun the audit"}
    return out


def _checked_words(checked: Optional[dict]) -> str:
    """The ``reduction`` fix's clause on what the audit measured of it (:func:`sync_grads_check`)."""
    if checked is None:
        return "(not checked by the audit: try it and rerun the audit)"
    if checked["within"]:
        return (f"(checked: with sync_grads=True DDP's gradient is one device's ({checked['ratio']:.3g}x the floor, "
                f"{checked['relative']:.3g} relative at most, every step from one device's weights))")
    return (f"(checked: sync_grads=True does not close it: DDP's gradient then differs from one device's by "
            f"{checked['relative']:.3g} relative, {checked['ratio']:.3g}x the floor; something else is left: rerun "
            "the audit after the change)")


def sync_grads_check(ddp: dict, single: dict, yardstick: float) -> dict:
    """What forcing ``sync_grads=True`` on the gathers leaves of DDP's gradient: ``{"steps": [relative
    difference per optimizer step], "relative": the largest, "ratio": relative / yardstick, "within":
    ratio <= FLOOR_FACTOR}``. ``ddp``: the [`StepProbe`][vae_ddp.probes.StepProbe] record of the
    ``SYNC_GRADS`` run (rank 0, every step from one device's weights); ``single``: one device's;
    ``yardstick``: the gradient's floor (relative, never below one rounding unit).

    Raises:
        ValueError: the two records' steps or gradients do not line up.
    """
    from vae_ddp.probes import per_step_differences

    steps = per_step_differences(ddp["grads"], single["grads"])
    relative = max(steps, default=0.0)
    return {"steps": steps, "relative": relative, "ratio": relative / yardstick,
            "within": relative <= FLOOR_FACTOR * yardstick}


@contextlib.contextmanager
def watch_gathers(force: bool = False) -> Iterator[list[str]]:
    """Within the block, note every call of ``LightningModule.all_gather`` (pytorch_lightning's) with
    ``sync_grads=False`` on a tensor that requires a gradient while gradients are enabled: the list
    it yields gets ``"file:line in function"`` of each such call site (once each), outside this
    package and Lightning. ``force``: those calls gather with ``sync_grads=True`` instead (the
    audit's check of its advice; every other call as made). The method is restored on exit."""
    import os

    import pytorch_lightning
    from pytorch_lightning import LightningModule

    import vae_ddp

    skip = tuple(os.path.dirname(m.__file__) + os.sep for m in (pytorch_lightning, vae_ddp))
    sites: list[str] = []
    original = LightningModule.all_gather

    def all_gather(self, data, group=None, sync_grads: bool = False):
        if not sync_grads and torch.is_grad_enabled() and any(
                isinstance(t, Tensor) and t.requires_grad for t in _tensors(data)):
            frame = next((f for f in reversed(traceback.extract_stack()[:-1]) if not f.filename.startswith(skip)),
                         None)
            site = f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}" if frame else "a call"
            if site not in sites:
                sites.append(site)
            sync_grads = force
        return original(self, data, group=group, sync_grads=sync_grads)

    LightningModule.all_gather = all_gather
    try:
        yield sites
    finally:
        LightningModule.all_gather = original


def _tensors(data) -> Iterator:
    if isinstance(data, Tensor):
        yield data
    elif isinstance(data, dict):
        for v in data.values():
            yield from _tensors(v)
    elif isinstance(data, (list, tuple)):
        for v in data:
            yield from _tensors(v)


def judge(ddp: dict, single: dict, gathers: list[str], yardstick: float, n: int,
          synced: Optional[dict] = None) -> dict:
    """Everything above for one audit: ``{"optimizers": per_optimizer(...), "unreduced": unreduced(...),
    "gathers": gathers, "sync_grads": sync_grads_check(...) or None, "findings": findings(...)}`` (see
    each; ``ddp``: the record of ``RANKS_GRADS``, ``single``: one device's, ``gathers``: what
    :func:`watch_gathers` saw in that run, ``synced``: the record of ``SYNC_GRADS``, or None where it
    did not run).

    Raises:
        ValueError: ``synced``'s steps do not line up with one device's.
    """
    groups = per_optimizer(ddp, single, yardstick, n)
    reduce = unreduced(ddp, single, yardstick)
    checked = sync_grads_check(synced, single, yardstick) if synced is not None and gathers else None
    return {"optimizers": groups, "unreduced": reduce, "gathers": list(gathers), "sync_grads": checked,
            "findings": findings(groups, reduce, gathers, yardstick, n, checked)}
