"""The audit's third stage: what the runs of a [`Measured`][vae_ddp.audit.measure.Measured] say
([`judge`][vae_ddp.audit.judge.judge] gives a [`Verdict`][vae_ddp.audit.verdict.Verdict]): the gradient
against its floor, the factors the runs were exposed to and what each contributes, the rest of the step,
the free-running trajectory, the effects and the exit code."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

import torch

from vae_ddp.audit import effects, exit_rule, loader_draws, localise, whole_step
from vae_ddp.audit.draws import draws_verdict
from vae_ddp.audit.measure import Measured
from vae_ddp.audit.plan import FLOOR_DRAWS, KEYED, Plan
from vae_ddp.audit.verdict import (FLOOR_RATIO, ROUNDING_EPS, TRAJECTORY_RATIO, Verdict, _clean, _factors, _name,
                                   _page, rounding_unit)
from vae_ddp.fixes import batchnorm, noise, registry
from vae_ddp.fixes.factor import AUDIT_OWN
from vae_ddp.harness.launch import RunFailed
from vae_ddp.probes import per_step_differences

__all__ = ["judge", "shown_name", "step_left"]


def _diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _largest(a: dict, b: dict, n: int = 3) -> list[dict]:
    """The ``n`` parameters or buffers of two saved states that differ most."""
    d = sorted(((float((a[k].double() - b[k].double()).abs().max()), k) for k in a), reverse=True)[:n]
    return [{"name": k, "max_abs_diff": v} for v, k in d]


def _gradient_verdict(plan: Plan, runs: Measured) -> dict:
    """The gradient, every step from one device's weights: DDP with every fix against one device,
    against the floor draws (the samples permuted) and one rounding unit; and the batch-to-batch
    noise the factors are set against."""
    base = plan.base
    floor_draws = [runs.per_step(f"floor-{k}") for k in range(1, FLOOR_DRAWS + 1)]
    one = runs.one_device
    noise_steps = _batch_noise(one["other-batch"][2] / "other-batch.steps.pt", one["single"][2] / "single.steps.pt",
                               plan.lag)
    grad_steps = runs.per_step("ddp+fixed-forced")
    eps = torch.finfo(torch.float64 if base.dtype == "float64" else torch.float32).eps
    unit = rounding_unit(base.dtype, (base.trainer or {}).get("precision"))
    floor = max((max(d, default=0.0) for d in floor_draws), default=0.0)
    yardstick = max(floor, unit)  # a difference below one rounding unit is rounding whatever the draws
    ratio = max(grad_steps, default=0.0) / yardstick
    # more than rounding: draws that do not follow their sample (at least 10 units of a reduced precision)
    deterministic = floor <= max(ROUNDING_EPS * eps, 10 * unit)
    reduction_ddp = None  # the reduction check under the process group: {"grad_steps", "ratio_to_floor"}
    if plan.recheck:
        eval_steps = runs.per_step("ddp+fixed-eval", reference="single-eval")
        reduction_ddp = {"grad_steps": eval_steps, "ratio_to_floor": max(eval_steps, default=0.0) / yardstick}
    return {"floor_draws": floor_draws, "noise_steps": noise_steps,
            "batch_noise": sum(noise_steps) / len(noise_steps) if noise_steps else None,
            "grad_steps": grad_steps, "eps": eps, "unit": unit, "floor": floor, "yardstick": yardstick,
            "ratio": ratio, "deterministic": deterministic, "grad_within": deterministic and ratio <= FLOOR_RATIO,
            "reduction_ddp": reduction_ddp,
            "reduced_globally": bool(deterministic and reduction_ddp
                                     and reduction_ddp["ratio_to_floor"] <= FLOOR_RATIO)}


def step_left(plan: Plan, runs: Measured) -> bool:
    """Whether the judgement may find something only the user's code fixes in DDP's step with every fix
    (``localise.RANKS_GRADS`` against ``single`` and the floor draws, ``other-batch``): the floor is not
    rounding, the gradient is not within its floor, or another part of the step differs (``_whole_step``'s
    findings). Asked inside the launch ([`vae_ddp.audit.run`][vae_ddp.audit.run]) to decide whether DDP with
    every fix measures an effect (``effect-fixed``); ``runs`` need hold only those runs.

    Raises:
        RunFailed: the runs' steps or gradients do not line up.
    """
    v = _gradient_verdict(plan, runs)
    if not v["deterministic"] or not v["grad_within"]:
        return True
    return bool(_whole_step(runs, plan.base.devices, v["eps"], v["grad_within"], v["unit"])["findings"])


def _exposures(plan: Plan, runs: Measured, v: dict) -> tuple[dict, dict, list[str]]:
    """``(found, manual, cleared)``: the exposed factors (as the default DDP run's ``DDPAudit`` and
    the one-process checks saw them), those only the user's code fixes, and the notes of what the
    runs cleared (seen, but with every fix the gradient is one device's)."""
    info = runs.ddp["ddp"][1]
    found = {f["factor"]: f for f in info["findings"] if not f.get("manual")}
    manual = {}  # exposed factors the audit cannot fix by itself (one-process checks)
    cleared = []
    for f in plan.static:
        if v["grad_within"]:
            # the one-process checks run without a process group; under the real one, with
            # every fix, DDP's gradient is one device's at every step: what they saw makes no
            # difference here (a loss reduced over the global batch already, by an all-reduced
            # item count or embeddings gathered with gradients; draws that happen to agree)
            what = ("the loss is already reduced over the global batch" if f.get("recheck")
                    else "it makes no difference to the gradient here")
            cleared.append(f"a one-process check flagged {_name(f['factor'])} ({f['evidence'].split(':')[0]}), but "
                           f"under DDP's process group the gradient matches one device's at every step: {what}")
            continue
        if f.get("recheck") and v["reduced_globally"]:
            # DDP still differs, but not by the reduction: in eval mode it matches one device
            cleared.append(f"a one-process check flagged {_name(f['factor'])} ({f['evidence'].split(':')[0]}), but "
                           "under DDP's process group, in eval mode (no dropout, BatchNorm's running statistics), "
                           "the gradient matches one device's at every step: the loss is already reduced over the "
                           "global batch; what DDP still changes is drawn or normalised in training mode")
            continue
        if f.get("recheck") and v["reduction_ddp"] is not None and v["deterministic"]:
            f = dict(f, evidence=f["evidence"] + f"; under DDP's process group too (eval mode, every fix): "
                                                 f"{v['reduction_ddp']['ratio_to_floor']:.3g}x the floor")
        manual[f["factor"]] = f
        if f["factor"] in found:
            f = dict(f, evidence=found[f["factor"]]["evidence"] + "; " + f["evidence"],
                     fix=found[f["factor"]]["fix"] + "; " + f["fix"])
        found[f["factor"]] = f
    # What only the user's code fixes, as the DDP runs saw it (with every fix on, else by default):
    # draws under GlobalBatchRandomness that it does not serve, ranks padded each to its own length.
    # It replaces what the automatic fix covers, and joins what the one-process checks found
    # (e.g. the loader's draws beside the step's).
    user_code = {f["factor"]: f for f in info["findings"] + runs.ddp["ddp+fixed"][1]["findings"] if f.get("manual")}
    for key, f in user_code.items():
        if v["grad_within"]:  # seen, but DDP with every fix computes one device's gradient: no difference here
            gist = re.split(r": | \(", f["evidence"], maxsplit=1)[0]
            cleared.append(f"the DDP runs saw, under {_name(key)}, that {gist}, but with every "
                           "fix the gradient matches one device's at every step: it makes no difference here")
            continue
        if key in manual:
            f = dict(f, evidence=manual[key]["evidence"] + "; " + f["evidence"],
                     fix=manual[key]["fix"] + "; " + f["fix"])
        manual[key] = found[key] = f
    return found, manual, cleared


def judge(plan: Plan, runs: Measured, notes: list[str]) -> Verdict:
    """The audit's third stage: the [`Verdict`][vae_ddp.audit.verdict.Verdict] of what ``runs`` measured
    for ``plan``. ``notes``: what the one-process checks could not do (the verdict's first notes).

    Raises:
        RunFailed: two runs' steps or gradients do not line up (they did not take the same steps).
    """
    base, n, one, first = plan.base, plan.base.devices, runs.one_device, runs.ddp
    v = _gradient_verdict(plan, runs)
    single, default, fixed = one["single"][0], first["ddp"][0], first["ddp+fixed"][0]
    found, manual, cleared = _exposures(plan, runs, v)
    ablated = [f for f in plan.fixes if f in found and f not in manual]
    # the ablation's runs of each factor it judges were trained: the ddp run saw it exposed (plan, audit.run)
    contributions: dict[str, Optional[float]] = {f: runs.largest(f"ddp-{f}") for f in ablated}
    # the same comparison with no fix, and with each fix alone: what that fix leaves of it
    none_fixed = runs.largest("ddp-forced") if v["deterministic"] else None
    alone = {f: runs.largest(f"ddp+{f}") for f in ablated}
    div_default = _diff(default, single)
    step = _whole_step(runs, n, v["eps"], v["grad_within"], v["unit"]) if v["deterministic"] else None
    for key, f in (step or {}).get("findings", {}).items():
        manual[key] = found[key] = f
    buffers_check = _buffers_follow(plan, runs, v, found, manual) if "buffers" in manual else None
    local, left_unnamed = _localised(runs, v, n, found, manual)
    # parameters apart from buffers, each against its own floor (never 0: one rounding unit, of bfloat16
    # under bf16-mixed, of the largest value); buffers a permutation moves are judged step by step
    free = whole_step.trajectory(single, one["permuted"][0], fixed,
                                 [b for b, _ in runs.record("single")["buffer_names"]],
                                 v["unit"], tuple((step or {}).get("order_buffers") or ()))
    within = v["grad_within"] and not (step or {}).get("differences") and free["ratio"] <= TRAJECTORY_RATIO
    items = loader_draws.verdict(first["ddp"][1].get("loader_draws")) if plan.items else None
    draws = (draws_verdict(plan.attention, plan.torch_draws, first["ddp"][1]["findings"], items)
             if plan.attention or plan.torch_draws or items else None)
    if draws is not None and draws["repeated"]:  # else independent draws of one distribution: the line says so
        manual[noise.FACTOR.key] = found[noise.FACTOR.key] = draws["finding"]
        within = False
    unexplained = v["deterministic"] and not within and not manual
    rows = _rows(found, manual, contributions, alone, v, none_fixed)
    defaults = _effects(plan, runs, rows, manual, v, step, local, left_unnamed)
    findings = sorted(rows, key=_rank)
    seen = [note for rs in (one, first) for _, i, _ in rs.values() for note in i.get("notes", [])]
    apart = exit_rule.apart(v["grad_within"], v["ratio"], (step or {}).get("differences"), free["ratio"], base.steps)
    exit_ = exit_rule.decide({"deterministic": v["deterministic"], "within_floor": within, "findings": findings,
                              "apart": apart})
    return Verdict(
        devices=n, steps=base.steps, dtype=base.dtype, method="teacher-forced",
        floor=v["floor"], floor_draws=v["floor_draws"], grad_steps=v["grad_steps"],
        ratio_to_floor=v["ratio"], none_fixed=none_fixed, batch_noise=v["batch_noise"],
        batch_noise_steps=v["noise_steps"],
        deterministic=v["deterministic"], within_floor=within, unexplained=unexplained,
        trajectory_floor=free["floor"], divergence_default=div_default, divergence_fixed=free["divergence"],
        trajectory_ratio=free["ratio"], trajectory_within=free["ratio"] <= TRAJECTORY_RATIO,
        trajectory_unit=free["unit"], trajectory_kind=free["kind"], trajectory_left_out=free["left_out"],
        gradient_within=v["grad_within"], rounding_unit=v["unit"],
        unkeyed_draws=None if draws is None else {k: val for k, val in draws.items() if k != "finding"},
        whole_step=None if step is None else {k: val for k, val in step.items() if k != "findings"},
        reduction_under_ddp=v["reduction_ddp"],
        buffers_check=buffers_check,
        localised=None if local is None else {k: val for k, val in local.items() if k != "findings"},
        effect=defaults, effect_rows=(defaults or {}).get("rows"),
        findings=findings, largest_differences=_largest(fixed, single) if unexplained else [],
        # as the user named them (path/to/file.py:Class, not the module the audit made of the file)
        model=dict(base.model, class_path=shown_name(base.model, base.model_file)),
        data=dict(base.data, class_path=shown_name(base.data, base.data_file)),
        global_batch_size=base.global_batch_size, trainer=base.trainer,
        model_name=shown_name(base.model, base.model_file), data_name=shown_name(base.data, base.data_file),
        notes=list(dict.fromkeys(list(notes) + cleared + seen)), exit_code=exit_["code"], exit_why=exit_["why"],
        runs=runs.runs, same_runs=runs.same_runs)


def _effects(plan: Plan, runs: Measured, rows: list[dict], manual: dict, v: dict, step: Optional[dict],
             local: Optional[dict], left_unnamed: bool) -> Optional[dict]:
    """Each row's ``mechanism`` (what the exposed factor does to the model DDP trains,
    [`exit_rule`][vae_ddp.audit.exit_rule]) and ``effect`` ([`effects`][vae_ddp.audit.effects], in place);
    returns the effect of Lightning's defaults as a whole (None where not measured)."""
    # the findings behind the rows: the default DDP run's that an automatic fix removes, and those left for the
    # user's code (not the ones the runs cleared: seen, but making no difference here)
    seen_findings = [f for f in runs.ddp["ddp"][1]["findings"] if not f.get("manual")] + list(manual.values())
    for row in rows:  # what each exposed factor does to the model DDP trains (vae_ddp.audit.exit_rule)
        row["mechanism"] = exit_rule.mechanism(row["factor"], seen_findings) if row["exposed"] else None
    measured = effects.measure(runs.record, plan.base, plan.fixes, {  # the same step within 2x the rounding floor
        "gradient": FLOOR_RATIO * v["yardstick"],
        "buffers": FLOOR_RATIO * (step or {}).get("buffer_floor", v["yardstick"])},
        # a gradient every fix leaves different, in the user's code alone: each factor's run carries it too
        residual=(("buffers",) if "buffers" in (step or {}).get("findings", {}) else ())
        + (("gradient",) if local is not None and (local["findings"] or left_unnamed) else ()),
        trained=[*runs.one_device, *runs.ddp])
    if plan.base.effect_batches and "fixed" not in measured and any(
            row["exposed"] and row["factor"] in manual and not row.get("follows") for row in rows):
        raise RunFailed(f"run '{effects.FIXED}' was not trained, but a factor only your code fixes was found: "
                        "the launch's decision (vae_ddp.audit.judge.step_left) missed it")
    effects.attach(rows, measured, {f.key: f.ablated_with or f.fixed_by for f in registry.factors()
                                    if f.ablated_with or f.fixed_by})
    for row in rows:  # rank 0's gradient is not DDP's step when every rank steps on its own: not measured
        if row["factor"] == "parameters" and (local or {}).get("unreduced") and row["exposed"]:
            row["effect"] = None
        if row.get("follows"):  # what every fix leaves is the rows it follows from: not its own effect
            row["effect"] = None
    return measured.get("defaults")


def _buffers_follow(plan: Plan, runs: Measured, v: dict, found: dict, manual: dict) -> Optional[dict]:
    """Whether the buffers that differ with every fix follow from the draws no automatic fix serves
    (torch's random functions in the step, named under ``noise``; per-rank BatchNorm statistics, when
    exposed, are fixed in every compared run): the runs ``KEYED`` of the launch, one device and DDP every
    fix on and those draws keyed to the samples ([`KeyedTorchDraws`][vae_ddp.audit.draws.KeyedTorchDraws]),
    trained where the deciding runs saw such draws ([`plan`][vae_ddp.audit.plan.plan]), their buffers
    compared as [`whole_step.compare`][vae_ddp.audit.whole_step.compare] does (against the floor draws'
    buffers). Only where the deterministic step's ``buffers`` row stands beside such draws and the compared
    runs did not key them already; else None (nothing compared). Launches nothing.

    Returns:
        ``{"rows": [factor keys], "closed": bool (the buffers within 2x their floor at every step),
        "buffer_ratio": float (the largest, over the floor), "gradient": float (the largest relative
        difference of DDP's gradient from one device's)}``; when ``closed``, ``found`` and ``manual``'s
        ``buffers`` row says it follows from ``rows`` (``follows``, ``mechanism: "follows"``, no fix of its own).

    Raises:
        RunFailed: the runs ``KEYED`` were not trained, or their steps do not line up with one device's.
    """
    draws = manual.get(noise.FACTOR.key)
    if not v["deterministic"] or draws is None or draws.get("unkeyed") or plan.base.keyed_draws:
        return None
    if not all(label in runs.one_device or label in runs.ddp for label in KEYED):  # not foreseen by the plan
        raise RunFailed(f"the buffers' check needs runs {' and '.join(KEYED)}, which the launch did not train "
                        f"(trained: {', '.join(runs.runs)})")
    single, keyed = runs.record(KEYED[0]), runs.record(KEYED[1])
    floors = [runs.record(f"floor-{k}") for k in range(1, FLOOR_DRAWS + 1)]
    try:
        step = whole_step.compare(keyed, single, floors, v["eps"], v["unit"] if v["unit"] > v["eps"] else 0.0)
        gradient = max(per_step_differences(keyed["grads"], single["grads"]), default=0.0)
    except (ValueError, RuntimeError) as err:
        raise RunFailed(f"run '{KEYED[1]}' cannot be compared with one device's step by step: {err}") from None
    rows = [noise.FACTOR.key] + [k for k in (batchnorm.FACTOR.key,) if k in found and k not in manual]
    closed = not any(d["part"] == "buffers" for d in step["differences"])
    check = {"rows": rows, "closed": closed, "buffer_ratio": step["buffer_ratio"], "gradient": gradient}
    if closed:
        names = " and ".join(_name(k) for k in rows)
        f = manual["buffers"]
        manual["buffers"] = found["buffers"] = dict(
            f, follows=rows, mechanism="follows",
            evidence=f"follows from {names}, not a cause of its own: with the audit's fixes for them (the draws "
                     "keyed to the samples, and every automatic fix on), DDP's buffers are one device's at every "
                     f"step ({step['buffer_ratio']:.2g}x their floor at most, every step from one device's "
                     f"weights; the gradient {gradient:.3g} relative); without the draws' fix: " + f["evidence"],
            fix=f"none of its own: the fixes above for {names}")
    return check


def _localised(runs: Measured, v: dict, n: int, found: dict, manual: dict) -> tuple[Optional[dict], bool]:
    """What every fix leaves of the gradient, optimizer by optimizer ([`localise`][vae_ddp.audit.localise]),
    where the step is deterministic and the gradient not within its floor: its findings join ``found`` and
    ``manual`` (a reduction finding merged with the one already there). Returns the localisation (None
    where not run) and whether nothing else was left for the user's code before it."""
    if not v["deterministic"] or v["grad_within"]:
        return None, False
    synced = runs.record(localise.SYNC_GRADS) if localise.SYNC_GRADS in runs.ddp else None
    try:
        local = localise.judge(runs.record(localise.RANKS_GRADS), runs.record("single"),
                               runs.ddp[localise.RANKS_GRADS][1].get("gathers") or [], v["yardstick"], n, synced)
    except (ValueError, RuntimeError) as err:  # the check's steps do not line up with one device's
        raise RunFailed(f"run '{localise.SYNC_GRADS}' cannot be compared with one device's step by step: {err}") \
            from None
    left_unnamed = not manual  # nothing else is left for the user's code
    for key, f in local.get("findings", {}).items():
        if key == "gradient_scale" and key in manual:  # the whole gradient's scale, named already
            continue
        if key == localise.REDUCTION and key in manual:
            f = dict(f, evidence=manual[key]["evidence"] + "; " + f["evidence"],
                     fix=f["fix"] + "; " + manual[key]["fix"])
        manual[key] = found[key] = f
    return local, left_unnamed


def _rows(found: dict, manual: dict, contributions: dict, alone: dict, v: dict,
          none_fixed: Optional[float] = None) -> list[dict]:
    """The table's rows, one per factor (the registry's, then the audit's own), unsorted. A factor
    whose fix changes nothing from either end ([`fix_changes_nothing`][vae_ddp.audit.localise.fix_changes_nothing],
    against ``none_fixed``, DDP with no fix) does not bite, whatever is left."""
    deterministic, grad_steps, batch_noise = v["deterministic"], v["grad_steps"], v["batch_noise"]
    rows = []
    for factor in _factors():
        f = found.get(factor)
        contribution = contributions.get(factor)
        other = registry.get(factor).ablated_with if factor in {g.key for g in registry.factors()} else None
        fixed_alone = alone.get(factor) if f else None
        if other in contributions and factor not in manual:
            contribution = contributions[other] if f else None  # that factor's fix removes this one too
            fixed_alone = alone[other] if f else None
        # what bites is in the user's code, which no automatic fix removes: measured by what is
        # left with every automatic fix on (shared by every such factor)
        left = (max(grad_steps, default=0.0) if factor in manual
                and (factor not in AUDIT_OWN or manual[factor].get("localised"))
                and not manual[factor].get("unkeyed") else None)
        if factor in manual:
            contribution = None
        if factor in manual or not deterministic:
            fixed_alone = None
        if not deterministic:  # against a floor that is not rounding, no contribution means anything
            contribution = left = None
        effect = contribution if left is None else left
        # a contribution over 2x what is left with every fix bites; under that, while what is left is
        # itself over 2x the floor, the two cannot be told apart (None: not separable)
        bites = None if contribution is None else contribution > FLOOR_RATIO * max(v["yardstick"], *grad_steps)
        if bites is False and not v["grad_within"]:
            bites = None
        nothing = bites is None and localise.fix_changes_nothing(contribution, max(grad_steps, default=0.0),
                                                                 fixed_alone, none_fixed)
        if nothing:
            bites = False
        rows.append({"factor": factor, "exposed": f is not None,
                     "evidence": f["evidence"] if f else _clean(factor),
                     "contribution": contribution, "bites": bites, "left_after_fixes": left,
                     "fixed_alone": fixed_alone, "fix_changes_nothing": nothing,
                     "vs_batch_noise": None if batch_noise is None or effect is None else effect / batch_noise,
                     "automatic_fix": f is not None and factor not in manual,
                     "follows": (f or {}).get("follows"),
                     "fix": f["fix"] if f else "", "page": _page(factor)})
    return rows


def _whole_step(runs: Measured, n: int, eps: float, grad_within: bool, unit: float) -> dict:
    """[`whole_step.compare`][vae_ddp.audit.whole_step.compare] of DDP with every fix, every step
    from one device's weights, with one device's record and the floor draws', plus
    ``"findings"``: the audit's own rows (``update``, ``buffers``, ``parameters``,
    ``gradient_scale``) for what differs, each ``{"factor", "evidence", "fix", "manual": True}``.
    The update follows the gradient: it is named only when the gradient is within the floor."""
    single, ddp = runs.record("single"), runs.record("ddp+fixed-forced")
    floors = [runs.record(f"floor-{k}") for k in range(1, FLOOR_DRAWS + 1)]
    try:
        step = whole_step.compare(ddp, single, floors, eps, unit if unit > eps else 0.0)
    except ValueError as err:
        raise RunFailed(f"run 'ddp+fixed-forced' cannot be compared with one device's step by step: {err}") from None
    # The update follows the gradient, and what the forward writes into buffers follows its inputs and
    # draws (a noise vector the fixes do not serve changes both): named only while the gradient is one
    # device's, and the update not where the ranks' own writes to the parameters explain it. The rate
    # and the ranks apart do not follow the gradient (an all-reduced gradient keeps the ranks alike).
    # Under a mixed precision the update is not judged: Adam divides each element by its own size, so a
    # gradient within a fraction of bfloat16's unit flips the sign of its smallest elements (measured:
    # 0.29 units of gradient, 0.4 of the update), and the permuted floor, bitwise one device's under
    # autocast, cannot show it.
    step["update_judged"] = unit <= eps
    apart = {d["step"] for d in step["differences"] if d["part"] == "ranks"}
    step["differences"] = [d for d in step["differences"] if d["part"] in {"learning rate", "ranks", "buffers"} or (
        grad_within and not (d["part"] == "update" and (d["step"] in apart or not step["update_judged"])))]
    findings = {}
    for d in step["differences"]:
        key = {"learning rate": "update", "ranks": "parameters"}.get(d["part"], d["part"])
        if key not in findings:
            findings[key] = dict(_explain(d, n), factor=key, manual=True)
    scale = None if grad_within else whole_step.scaled_by_world_size(ddp["grads"], single["grads"], n)
    if scale is not None:
        how = "divided by" if scale < 1 else "multiplied by"
        findings["gradient_scale"] = {
            "factor": "gradient_scale", "manual": True,
            "evidence": f"DDP's gradient is one device's times {scale:.3g} at every step (the loss is {how} the "
                        f"world size, {n}), and otherwise the same",
            "fix": "delete the factor: DDP already averages the gradients over the ranks, so the mean loss of the "
                   "per-device batch gives one device's gradient of the global batch"}
    step["gradient_scale"] = scale
    return dict(step, findings=findings)


def _explain(d: dict, n: int) -> dict:
    """Evidence and fix of one part of the step that differs (``whole_step.compare``'s ``differences``)."""
    names = ", ".join(f"{x['name']} ({x['max_abs_diff']:.3g}" + (f", {x['module']}" if x.get("module") else "") + ")"
                      for x in d["names"])
    at = f"at step {d['step']} (every step from one device's weights)"
    after = f"after step {d['step']} (every step from one device's weights)"
    if d["part"] == "learning rate":
        ddp, single = d["detail"]["ddp"], d["detail"]["single"]
        rates = f"{', '.join(f'{v:.3g}' for v in ddp)} on DDP vs {', '.join(f'{v:.3g}' for v in single)} on one device"
        if abs(d["ratio"] / n - 1) < 1e-6:
            return {"evidence": f"the learning rate is multiplied by the world size {at}: {rates}",
                    "fix": "at the same global batch size DDP takes one device's learning rate: remove the factor "
                           "self.trainer.world_size (scaling the rate with the world size is for a global batch "
                           "that grows with it)"}
        return {"evidence": f"the learning rate differs {at}: {rates} ({d['ratio']:.3g}x): a schedule that counts "
                            "other steps under DDP, e.g. total_steps from len(train_dataloader()), the per-device "
                            "loader, or from the world size",
                "fix": "compute the schedule's length from self.trainer.estimated_stepping_batches (optimizer steps "
                       "over the global batch, as Lightning counts them under DDP)"}
    if d["part"] == "update":
        return {"evidence": f"the same gradient and learning rate, but the parameters differ {after}: "
                            f"{d['ratio']:.3g}x the floor; largest in {names}",
                "fix": "find what changes the update under DDP: the optimizer's state or arguments (built from the "
                       "world size or the rank), a step that runs on some ranks only, or a forward that writes to "
                       "parameters"}
    if d["part"] == "buffers":
        return whole_step.explain_buffers(d, after)
    renorm = any("max_norm" in (x.get("module") or "") for x in d["names"])
    return {"evidence": f"the ranks' parameters are apart {after}: {d['ratio']:.3g}x the floor; largest "
                        f"in {names}"
                        + ("; nn.Embedding(max_norm=...) renormalises in place, in forward, the rows its rank looks "
                           "up, and DDP never synchronises parameters again" if renorm else ""),
            "fix": ("drop max_norm, or renormalise the same rows on every rank after the optimizer step (all of "
                    "them, or those of the global batch)" if renorm else
                    "change parameters only through the optimizer, or by the same values on every rank: DDP "
                    "synchronises parameters once, when it wraps the module")}


def _rank(f: dict) -> tuple:
    """Table order: exposed first; among them what changes what DDP trains, then what is not
    measured or not resolved, then what changes only the luck or nothing
    ([`effects.rank`][vae_ddp.audit.effects.rank]); within each, what changes the model DDP trains by its
    mechanism ([`exit_rule`][vae_ddp.audit.exit_rule]) first; then what bites and what only the user's code can fix,
    by their measured effect (a contribution; for the latter, what is left with every automatic
    fix on), then such a factor not measured (the floor is not rounding), then what cannot be
    separated, then what does not bite: a factor that needs a code change never ranks below one
    that does not bite. A factor whose fix changes nothing from either end (``fix_changes_nothing``)
    comes after every other exposed one: it is never the headline."""
    if not f["exposed"]:
        return (1, 0, 0.0)
    if f.get("fix_changes_nothing"):  # never the headline: below every exposed factor whose fix matters
        return (0, 3, 1, 0, 0.0)
    if f.get("follows"):  # what follows from other rows is never the headline either
        return (0, 3, 1, 0, 0.0)
    left = f.get("left_after_fixes")
    if f["bites"] or (not f["automatic_fix"] and left is not None):
        order = 0
    elif not f["automatic_fix"]:
        order = 1
    elif f["bites"] is None:
        order = 2
    else:
        order = 3
    another = 0 if f.get("mechanism") == exit_rule.ANOTHER_MODEL else 1
    return (0, effects.rank(f), another, order, -((f["contribution"] if left is None else left) or 0.0))


def _batch_noise(other: Path, single: Path, lag: int) -> list[float]:
    """Per optimizer step, how far another batch moves one device's gradient at the same weights:
    ``||g(θ_k, batch of step k+1) - g(θ_k, batch of step k)|| / ||g(θ_k, batch of step k)||``,
    from the ``other-batch`` run (batch b from the weights of batch b - ``lag``) and the
    reference's gradient of batch b - ``lag``, optimizer by optimizer (a GAN steps two per
    batch); none for a single step."""
    from vae_ddp.probes import relative_difference

    ref, rec = torch.load(single), torch.load(other)
    by_batch: dict[int, list] = {}
    for b, g in zip(ref.get("grad_batches", []), ref["grads"]):
        by_batch.setdefault(b, []).append(g)
    out, seen = [], {}
    for b, g in zip(rec.get("grad_batches", []), rec["grads"]):
        i = seen[b] = seen.get(b, -1) + 1  # the i-th optimizer step of batch b
        base = by_batch.get(b - lag, [])
        if b >= lag and i < len(base) and base[i].shape == g.shape and base[i].numel():
            out.append(relative_difference(g, base[i]))
    return out


def shown_name(cls: dict, file: Optional[str]) -> str:
    """The class as the user named it: ``path/to/file.py:Class`` (relative to the working
    directory) for a class given by file, else its dotted ``class_path``."""
    if not file:
        return cls["class_path"]
    try:
        where = os.path.relpath(file)
    except ValueError:  # another drive (Windows)
        where = file
    if where.startswith(".."):  # outside the working directory: where it is
        where = file
    return f"{where}:{cls['class_path'].rpartition('.')[2]}"

