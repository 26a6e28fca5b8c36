"""What each exposed factor does to what DDP trains: a bias, a noise ratio, or only other luck.

The audit's contribution of a factor is one step's gradient difference from one device's: it
cannot tell DDP taking other samples or draws (``DistributedSampler``'s order: the same model,
other luck) from DDP computing another step (per-rank BatchNorm statistics: another model). This
module measures the difference as a distribution
([`vae_ddp.harness.effect`][vae_ddp.harness.effect]): one device and DDP each take ``effect_batches``
global batches (``ROWS`` by default), ``effect_batches / points`` of them from each of the
reference's first ``points`` weights
θ_0, θ_1 (``AuditRun.repeat``; ``points`` = ``min(POINTS, steps)``), every batch from those
weights, the batches and draws following on as training takes them:

- ``effect-single``: one device, every fix on (the reference's step);
- ``effect-<factor>``: DDP with every fix but that factor's (what the factor changes), only where the factor,
  or one its fix removes too, is exposed;
- ``effect-defaults``: DDP with Lightning's defaults (what DDP as the user runs it changes);
- ``effect-fixed``: DDP with every fix on (what is left for the user's code: the effect of a factor
  that only the user's code fixes, as ``left_after_fixes`` is its contribution), only where something may be
  left for that code (``vae_ddp.audit.spec.LEFT``).

Row ``i`` pairs one device's ``i``-th optimizer step with DDP's: the same weights, the same global
batch and draws where DDP takes them (every fix on), its own where it does not. Two quantities are
compared (``QUANTITIES``): the gradient (what the optimizer receives; the update would carry each
run's own optimizer state) and what each batch's forward writes into the floating-point buffers
(BatchNorm's running statistics, which DDP keeps from rank 0 and the model evaluates with), each
row counted the same step when within ``FLOOR_RATIO`` times the audit's floor; a factor's effect is
the more serious of the two. Where DDP takes other samples than one device (no sampler fix), the
batches of each epoch are one observation of the bias (``blocks``): over an epoch of a small data set
both sides take every sample once, which a row-by-row noise estimate would not know. A vector longer
than ``SKETCH`` elements is recorded as its CountSketch: the same linear map for one device and DDP,
which keeps norms, inner products and so the traces the decomposition reads in expectation.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Collection, Optional

from vae_ddp.audit.spec import AuditRun
from vae_ddp.fixes import registry, sampler
from vae_ddp.harness import effect as stats
from vae_ddp.harness.table import format_table

#: How the table names the floor of "nothing" (the audit's rule).
FLOOR_WORDS = "2x the rounding floor"

__all__ = ["ROWS", "POINTS", "QUANTITIES", "CHANGES", "measured_by", "plan", "measure", "attach", "rank", "render"]

#: Global batches each effect run takes by default (paired rows; ``AuditRun.effect_batches``, the
#: audit's ``--effect_batches``): about 30 show ``same distribution`` for a gradient of a few
#: effective dimensions at the margins of [`vae_ddp.harness.effect`][vae_ddp.harness.effect].
ROWS = AuditRun.effect_batches
#: Points of training (the reference's first weights) the rows are spread over.
POINTS = 2

#: Vectors longer than this are compared through their CountSketch of this length
#: ([`count_sketch`][vae_ddp.probes.count_sketch]): 32 steps of a ResNet-18's float64 gradient,
#: update and buffers would take 6 GB per run and rank (the audit was killed for memory).
SKETCH = 4096

#: What the effects are measured on: the gradient and what the forward writes into the buffers.
QUANTITIES = ("gradient", "buffers")

REFERENCE = "effect-single"
DEFAULTS = "effect-defaults"
FIXED = "effect-fixed"


def _forced(base: AuditRun, steps_file: str) -> dict:
    accumulate = int(base.trainer.get("accumulate_grad_batches") or 1)
    points = max(1, min(POINTS, base.steps))
    per_point = base.effect_batches // points
    return dict(steps_file=steps_file, teacher_forced=True, repeat=per_point * accumulate, steps=points * per_point,
                sketch=SKETCH)


def measured_by(key: str) -> list[str]:
    """The factors whose effect the run of fixable factor ``key`` (``effect-<key>``) measures: ``key``, and
    those whose fix is its fix (``ablated_with`` or ``fixed_by``: the reduction's padding by the sampler's
    run, the optimizer by the noise's; [`attach`][vae_ddp.audit.effects.attach]), in registry order."""
    return [key] + [f.key for f in registry.factors() if f.key != key and (f.ablated_with or f.fixed_by) == key]


def plan(base: AuditRun, fixes: list[str], steps_file: str) -> tuple[list[AuditRun], list[AuditRun]]:
    """``(one device's run, DDP's runs)`` that measure the effects, to join the audit's launch
    (after the reference, whose weights they wait for). ``base``: the audit's run (``devices``
    the DDP world size); ``fixes``: the fixes the audit applies; ``steps_file``: the reference's weights.
    A factor's run (``effect-<key>``) trains only when the first DDP run sees one of the factors it
    measures exposed ([`measured_by`][vae_ddp.audit.effects.measured_by], ``AuditRun.if_seen``); one
    device's, Lightning's defaults' and every fix's always."""
    if not base.effect_batches:
        return [], []
    forced = _forced(base, steps_file)
    one = [base.replace(label=REFERENCE, devices=1, fixes=list(fixes), **forced)]
    ddp = [*(base.replace(label=f"effect-{f}", devices=base.devices, fixes=[g for g in fixes if g != f],
                          if_seen=measured_by(f), **forced)
             for f in fixes),
           base.replace(label=DEFAULTS, devices=base.devices, fixes=[], **forced),
           base.replace(label=FIXED, devices=base.devices, fixes=list(fixes), **forced)]
    return one, ddp


def _pairs(single: dict, ddp: dict, repeat: int, quantity: str, blocks: bool) -> dict:
    """The paired rows of two [`StepProbe`][vae_ddp.probes.StepProbe] records as
    [`decompose`][vae_ddp.harness.effect.decompose]'s arguments. ``quantity``: ``"gradient"``, one row
    per optimizer step, grouped by the weights it started from and its place among its batch's
    optimizer steps (a GAN steps two optimizers per batch); ``"buffers"``, what each training batch's
    forward wrote into the floating-point buffers (BatchNorm's running statistics), grouped by the
    weights. ``blocks``: each row's epoch in both runs, for runs that take other samples than one
    device (the batches of one epoch of a small data set take every sample once on both sides).
    Rows of the most common length only."""
    ex, ey = single.get("epochs") or [], ddp.get("epochs") or []
    if quantity == "gradient":
        seen: Counter = Counter()
        keys = []
        for b in single["grad_batches"]:
            keys.append((b, seen[b]))
            seen[b] += 1
        pairs = zip(keys, single["grads"], ddp["grads"])
    else:
        pairs = (((b, 0), x, y) for b, (x, y) in enumerate(zip(single["buffer_updates"], ddp["buffer_updates"])))
    rows = [(x, y, (b // max(repeat, 1), i), (ex[b] if b < len(ex) else 0, ey[b] if b < len(ey) else 0))
            for (b, i), x, y in pairs if x.shape == y.shape and x.numel()]
    common = Counter(r[0].numel() for r in rows).most_common(1)
    rows = [r for r in rows if common and r[0].numel() == common[0][0]]
    out = {"single": [r[0].numpy() for r in rows], "ddp": [r[1].numpy() for r in rows],
           "groups": [str(r[2]) for r in rows]}
    return dict(out, blocks=[str(r[3]) for r in rows]) if blocks else out


def measure(record: Callable[[str], dict], base: AuditRun, fixes: list[str], floor: dict,
            residual: tuple = (), trained: Optional[Collection[str]] = None) -> dict:
    """``{factor, "defaults" or "fixed": effect}``: [`decompose`][vae_ddp.harness.effect.decompose] of each
    effect run against ``effect-single`` (``record(label)``: a run's StepProbe record; ``trained``: the
    labels of the runs trained, None for all: a factor whose ``effect-<key>`` did not train, none of the
    factors it measures exposed, has no key, nor ``"fixed"`` where nothing was left for the user's code), on the
    gradient
    and, where the model has floating-point buffers, on what each batch wrote into them (DDP keeps
    rank 0's); the effect is the more serious of the two (``KINDS``' order), with ``"quantity"``
    naming it and ``"quantities"`` holding both. ``floor``: per quantity, the relative difference
    within which a row is the same step. ``residual``: the quantities in which DDP with every fix on
    already differs from one device (the whole step's comparison, e.g. buffers a rank writes from its
    own share of the batch): a factor's run carries that difference too, so they are measured for
    Lightning's defaults and for every fix on (``"fixed"``, where that difference is what is measured)
    only, never as a factor's effect. Rows that cannot be compared (too few, of
    other lengths) give None."""
    if not base.effect_batches:
        return {}
    repeat = _forced(base, "")["repeat"]
    reference = record(REFERENCE)
    out: dict[str, Optional[dict]] = {}
    for key, label, fixed in [(k, label, fixed) for k, label, fixed in (
            [(f, f"effect-{f}", [g for g in fixes if g != f]) for f in fixes]
            + [("defaults", DEFAULTS, []), ("fixed", FIXED, list(fixes))]) if trained is None or label in trained]:
        run = record(label)
        parts = {}
        for quantity in QUANTITIES:
            if quantity in residual and key not in ("defaults", "fixed"):
                continue
            try:
                parts[quantity] = stats.decompose(**_pairs(reference, run, repeat, quantity,
                                                           sampler.FACTOR.key not in fixed),
                                                  floor=floor[quantity])
            except ValueError:  # no such rows (no buffers), or too few
                continue
        if not parts:
            out[key] = None
            continue
        worst = min(parts, key=lambda q: stats.KINDS.index(parts[q]["kind"]))
        out[key] = dict(parts[worst], quantity=worst, quantities=parts)
    return out


def attach(rows: list[dict], effects: dict, ablated_with: dict) -> None:
    """Give each row of the audit's table its ``effect`` (``{"kind", "bias", "bias_ci",
    "variance_ratio", "variance_ratio_ci"}``, or None): an exposed factor the audit fixes, by its own
    effect run or that of the factor whose fix removes it too (``ablated_with``: the reduction's padding
    by the sampler's, the optimizer by the noise's); an exposed factor only the user's code fixes, by
    DDP with every fix on (``"fixed"``: what is left for the user's code, shared by every such row). None
    where no run measures it (logging: the audit applies no logging fix, and logging changes no step)."""
    keys = ("kind", "bias", "bias_ci", "variance_ratio", "variance_ratio_ci", "quantity", "rows")
    for row in rows:
        e = None
        if row["exposed"] and row["automatic_fix"]:
            e = effects.get(row["factor"]) or effects.get(ablated_with.get(row["factor"]) or "")
        elif row["exposed"]:
            e = effects.get("fixed")
        row["effect"] = None if e is None else {k: e[k] for k in keys}


def rank(row: dict) -> int:
    """Among the exposed rows: 0 for what changes what DDP trains (``different``), 2 for what changes
    only the luck or nothing (``same distribution``, ``exact``), 1 for the rest (not measured, inconclusive)."""
    kind = (row.get("effect") or {}).get("kind")
    return 0 if kind == "different" else 2 if kind in ("same distribution", "exact") else 1


#: The table's words for each kind: what the factor changes.
CHANGES = {"different": "what DDP trains", "same distribution": "only which samples or draws",
           "exact": "nothing: the same step", "inconclusive": "not resolved"}


def _interval(value: float, ci: list) -> str:
    return f"{value:.2g} [{ci[0]:.2g}, {ci[1]:.2g}]"


def render(result: dict, name: Callable[[str], str]) -> list[str]:
    """The effects as a table (a row per exposed factor measured, what changes what DDP trains first,
    then Lightning's defaults as a whole), what its columns mean, and each row's intervals; no lines
    when nothing was measured. ``name``: a factor key's name in the report."""
    rows = [(name(f["factor"]), f["effect"]) for f in result["findings"] if f.get("effect")]
    if result.get("effect"):
        rows.append(("Lightning's defaults", result["effect"]))
    if not rows:
        return []
    cells = [[n, CHANGES[e["kind"]] + (" (buffers)" if e.get("quantity") == "buffers" and e["kind"] != "exact" else ""),
              f"{e['bias']:.2g}", f"{e['variance_ratio']:.2g}"] for n, e in rows]
    m = result.get("effect_rows")
    lines = [format_table(["factor", "changes", "bias (sd)", "noise ratio"], cells,
                          title=f"What each exposed factor and Lightning's defaults as a whole change, over {m} global "
                                f"batches from one device's weights"),
             "",
             "changes: what DDP trains (a bias or a noise ratio shown at 95%), only which samples or draws (both "
             f"shown within their margins at 95%: a bias below {stats.BIAS_MARGIN:g} sd, a noise ratio within "
             f"{1 / stats.RATIO_MARGIN:g}-{stats.RATIO_MARGIN:g}), nothing (every batch gives one device's step within "
             f"{FLOOR_WORDS}), or not resolved (neither shown). bias: DDP's mean step off one device's, "
             "in one device's "
             "step-to-step standard deviations at the same weights; noise ratio: DDP's step-to-step variance over one "
             "device's. Measured on the gradient and on what each batch writes into the buffers (DDP keeps rank 0's), "
             "the more serious of the two shown. The batches and their draws are those training takes, one device's "
             "or DDP's own where the factor changes them. Intervals (95%):", ""]
    return lines + [f"- {n}: bias {_interval(e['bias'], e['bias_ci'])} sd, noise ratio "
                    f"{_interval(e['variance_ratio'], e['variance_ratio_ci'])}, on the {e.get('quantity', 'gradient')}"
                    for n, e in rows]
