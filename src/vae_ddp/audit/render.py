"""The Markdown report of an audit ([`Verdict`][vae_ddp.audit.verdict.Verdict] in, text out): first the
exit code and the verdict in words ([`headline`][vae_ddp.audit.render.headline]), each cause with its fix and
the verdict's line ([`summary`][vae_ddp.audit.render.summary]); then the evidence: the ranked table of the
factors, the effects' table, what the step measured against its floors and the free-running trajectory as
context."""

from __future__ import annotations

import torch

from vae_ddp.audit import effects, exit_rule, localise, whole_step
from vae_ddp.audit.verdict import (FLOOR_RATIO, ROUNDING_EPS, TRAJECTORY_RATIO, Verdict, _factors, _name,
                                   rounding_unit)
from vae_ddp.fixes import noise
from vae_ddp.fixes.factor import page_url
from vae_ddp.harness.table import format_table

__all__ = ["render", "summary", "headline", "verdict_line"]

#: What a row of a factor that changes only which samples DDP takes (its mechanism
#: ``"same distribution"``: Lightning's shuffling DistributedSampler) says beside its number, by ``bites``.
LUCK = {True: "only which samples (luck)", False: "does not bite", None: "not separable"}


def render(verdict: Verdict) -> str:
    """The Markdown the audit prints and writes as ``tables.md`` (without its last newline): the
    [`summary`][vae_ddp.audit.render.summary] (the exit code and the verdict in words, each cause with its
    fix, the verdict's line), then the evidence: the ranked table, the effects, what the step measured
    against its floors, the free-running trajectory as context, the notes. A verdict read back from an
    ``audit.json``: ``render(Verdict.from_dict(json.loads(text)))``."""
    u = _Units(verdict)
    lines = summary(verdict) + [""] + _render_table(verdict, u) + [""] + effects.render(verdict.to_dict(), _name)
    lines += [""] * bool(lines[-1]) + _render_measures(verdict, u)
    lines.append(_render_trajectory(verdict, u))
    lines += [f"- note: {n}" for n in verdict.notes]
    return "\n".join(lines)


class _Units:
    """What the report's lines share: the rounding unit (of the dtype the step computes in), the
    floor it sets, the number of steps in words."""

    def __init__(self, verdict: Verdict) -> None:
        self.dtype = verdict.dtype
        self.precision = (verdict.trainer or {}).get("precision")
        self.eps = rounding_unit(self.dtype, self.precision)
        self.computes_in = {torch.finfo(torch.bfloat16).eps: "bfloat16", torch.finfo(torch.float16).eps: "float16"}.get(
            self.eps, self.dtype) if self.precision else self.dtype
        self.yardstick = max(verdict.floor, self.eps)
        self.steps = verdict.steps
        self.steps_text = f"{self.steps} step" + ("" if self.steps == 1 else "s")

    def vs_floor(self, v: float) -> str:  # short: the table fits 100 columns
        return f"{v:.3g} ({v / self.yardstick:.2g}x floor)"


def _render_table(verdict: Verdict, u: _Units) -> list[str]:
    """The ranked table, what its columns mean, and each factor's evidence and fix."""
    def contribution(f: dict) -> str:
        if f.get("follows"):
            return "follows from " + ", ".join(_name(k) for k in f["follows"])
        c, left = f["contribution"], f.get("left_after_fixes")
        if left is not None:
            return f"your code: {u.vs_floor(left).replace(' (', ' left (', 1)}"
        if c is None:
            return "needs your code" if f["exposed"] and not f["automatic_fix"] else ""
        if f["exposed"] and f.get("mechanism") == exit_rule.SAME_DISTRIBUTION:  # another data order's luck
            return f"{c:.3g}: {LUCK[f['bites']]}"
        verdict = {True: "", False: ": does not bite", None: ": not separable"}[f["bites"]]
        return u.vs_floor(c) + verdict

    def vs_noise(f: dict) -> str:
        v = f.get("vs_batch_noise")
        return "" if v is None else f"{v:.2g}x"

    def alone(f: dict) -> str:
        a, none = f.get("fixed_alone"), verdict.none_fixed
        if a is None or none is None:
            return ""
        return (f". With only this fix on: {u.vs_floor(a)}; with no fix: {none:.3g}"
                + (": its fix changes nothing here, from either end" if f.get("fix_changes_nothing") else ""))

    rows = [[_name(f["factor"]), "yes" if f["exposed"] else "no", contribution(f), vs_noise(f)]
            for f in verdict.findings]
    batch_noise = verdict.batch_noise
    title = (f"Audit of {verdict.model_name or verdict.model['class_path']} "
             f"on {verdict.devices} devices vs one, "
             f"global batch {verdict.global_batch_size}, {u.steps_text}, {u.dtype}"
             + "".join(f", {k}={v}" for k, v in (verdict.trainer or {}).items()))
    lines = [format_table(["factor", "exposed", "contribution", "vs another batch"], rows, title=title), "",
             "contribution: with every fix on but this factor's, every step started from one device's weights, "
             "the largest relative difference of DDP's gradient from one device's (for a factor that needs your "
             "code: what is left with every automatic fix on). vs another batch: that difference over the one "
             "another batch makes to one device's gradient at the same weights ("
             + (f"{batch_noise:.3g} relative, the mean over {len(verdict.batch_noise_steps)} steps)"
                if batch_noise is not None
                else "not measured: it needs two optimizer steps)")
             + ": below 1, the factor moves the gradient less than the batch-to-batch noise of training. "
             + (f"{LUCK[True]}: the factor changes only which samples DDP takes from one device's distribution, so "
                "its number is the difference another data order makes, luck and no multiple of the floor. "
                if any(contribution(f).endswith(LUCK[True]) for f in verdict.findings) else "")
             + "Evidence and fix, per factor:", ""]
    return lines + [f"- {_name(f['factor'])}: {f['evidence']}" + (f". Fix: {f['fix']}" if f["fix"] else "") + alone(f)
                    + f" (see {page_url(f['page'])})" for f in verdict.findings]


def _render_measures(verdict: Verdict, u: _Units) -> list[str]:
    """The gradient against its floor, the rest of the step against theirs, the two parts of attention dropout."""
    lines = [f"- every step from one device's weights: DDP with every fix differs from one device's gradient by "
             f"{max(verdict.grad_steps, default=0.0):.3g} relative at most ({verdict.ratio_to_floor:.3g}x the "
             f"floor); the floor, one device with the samples inside each batch permuted "
             f"({len(verdict.floor_draws)} draws): {verdict.floor:.3g}"
             + (f" (below one machine epsilon of {u.computes_in}, {u.eps:.3g}, which the ratio takes instead)"
                if verdict.floor < u.eps else "")]
    step = verdict.whole_step
    if step is not None:
        lr = "the same" if not any(d > whole_step.LR_TOLERANCE for d in step["lr_steps"]) else "differs"
        lines.append(f"- the rest of each step, from the same weights, against the same floor: learning rate {lr}; "
                     f"update {step['update_ratio']:.2g}x its floor ({step['update_floor']:.3g} relative"
                     + ("" if step.get("update_judged", True) else
                        f", not judged under {u.precision}: Adam divides each element by its own size, and a "
                        "gradient within a fraction of the rounding unit flips the sign of its smallest elements")
                     + "); "
                     + (f"buffers {step['buffer_ratio']:.2g}x ({step['buffer_floor']:.3g}"
                        + "".join(f"; {b}: {f:.3g} when permuted, not rounding: against the step's rounding, "
                                  f"{step['rounding_floor']:.3g}" for b, f in (step.get("order_buffers") or {}).items())
                        + "); " if step.get("buffer_count")
                        else "no floating-point buffers; ")
                     + "every rank's parameters against "
                     f"rank 0's {step['ranks_ratio']:.2g}x (one rounding of every stored value is the least "
                     "difference counted)")
    draws = verdict.unkeyed_draws
    if draws:
        parts = ([f"the dropout inside scaled_dot_product_attention in {', '.join(draws['attention'])} (off in every "
                  "compared run)"] if draws["attention"] else [])
        parts += ([f"{', '.join(draws['torch'])} (keyed to the samples in every compared run)"]
                  if draws["torch"] else [])
        parts += (["the dataset's draws in __getitem__ (keyed to each sample's index in every compared run)"]
                  if draws.get("dataset") else [])
        lines.append("- in two parts, for draws no run can key to a sample as your code makes them, "
                     f"{' and '.join(parts)}: "
                     "the rest of the step is judged here; the draws themselves are "
                     + ("the same on every rank under Lightning's defaults: not one device's independent rows (see "
                        f"{_name(noise.FACTOR.key)})" if draws["repeated"] else
                        "different on every rank: independent draws, as one device's rows are")
                     + (f" (the dataset's: {draws['dataset']['short' if draws['repeated'] else 'state']})"
                        if draws.get("dataset") else ""))
    return lines


def summary(verdict: Verdict) -> list[str]:
    """The report's first lines: the [`headline`][vae_ddp.audit.render.headline] (the exit code and the
    verdict in words), each factor behind an exit code 1 with its fix (as its finding gives it, Lightning's
    switch first where there is one), then the [`verdict_line`][vae_ddp.audit.render.verdict_line]."""
    causes = {f["factor"]: f for f in verdict.findings}
    lines = [headline(verdict)]
    lines += [f"- {_name(k)}. Fix: {causes[k]['fix']}" for k in verdict.exit_why
              if k in causes and causes[k].get("fix") and verdict.deterministic]
    return lines + [verdict_line(verdict)]


def headline(verdict: Verdict) -> str:
    """One line that opens the report: ``exit 1: ...`` or ``exit 0: ...``, what the exit code says of the
    model DDP trains as the user runs it ([`exit_rule`][vae_ddp.audit.exit_rule]): for a 1 the causes
    (``exit_why``: the factors by name, then what else is not within its floor), nothing of DDP where the
    audit could not judge; for a 0 what the study shows (one device's whole step with the fixes, and what
    alone differs without them)."""
    if not verdict.deterministic:
        return (f"exit 1: not judged: one device's own gradient changes by {verdict.floor:.3g} relative when the "
                "samples inside its batches are permuted, more than rounding, so no comparison with one device "
                "can tell DDP's difference from that")
    named = [_name(k) for k in verdict.exit_why if k in _factors()]
    rest = [w for w in verdict.exit_why if w not in _factors()]
    if verdict.exit_code:
        why = ", ".join(named) + ("; " if named and rest else "") + "; ".join(rest) \
            + ("; not one of the known factors" if verdict.unexplained else "")
        return "exit 1: DDP does not train one device's model as you run it" + (f", because of: {why}" if why else "")
    exposed = [f for f in verdict.findings if f["exposed"] and not f.get("follows")]
    samples = [_name(f["factor"]) for f in exposed
               if f.get("mechanism") == exit_rule.SAME_DISTRIBUTION and f["bites"] is not False]
    logs = [_name(f["factor"]) for f in exposed if f.get("mechanism") == exit_rule.PLOT]
    draws = verdict.unkeyed_draws
    parts = ([f"which samples it takes from one device's distribution ({', '.join(samples)})"] if samples else []) \
        + (["independent draws on every rank, as one device's rows are"] if draws and not draws["repeated"] else []) \
        + ([f"what it logs ({', '.join(logs)})"] if logs else [])
    quiet = (f"none of the exposed factors ({', '.join(_name(f['factor']) for f in exposed)}) changes the gradient "
             "here" if exposed else "no factor is exposed")
    return (f"exit 0: DDP trains one device's model as you run it: with the fixes it computes one device's whole "
            f"step, each part within {FLOOR_RATIO:g}x its floor; "
            + (f"as you run it, it differs only in {' and '.join(parts)}" if parts else quiet))


def verdict_line(verdict: Verdict) -> str:
    """The report's verdict line (``- passed: ...``, ``- unexplained: ...`` with the parameters and buffers
    that differ most, ...): what the command prints, for the pytest helper's message."""
    return _render_verdict(verdict, _Units(verdict))


def _render_verdict(verdict: Verdict, u: _Units) -> str:
    """One line: not judged, unexplained, not passed (what differs first, what only the user's code
    fixes) or passed."""
    if not verdict.deterministic:
        unserved = any(f["factor"] == noise.FACTOR.key and f["exposed"] and not f["automatic_fix"]
                       for f in verdict.findings)
        why = ("the training step draws random numbers that do not follow their sample, from torch's global "
               "generator, which the audit's fix does not serve (see Random streams per rank)" if unserved else
               "most likely random draws that do not follow their sample (NumPy's or Python's random in "
               "training_step, say; the audit keys torch's random functions, dropout masks and a `noise` attribute "
               "to the samples itself), or a loss that depends "
               "on the order of the samples")
        return (f"- not judged: permuting the samples inside each batch changes one device's gradient by "
                f"{verdict.floor:.3g} relative, more than rounding ({ROUNDING_EPS:g} eps of {u.dtype}"
                + (f", 10 eps of {u.computes_in}" if u.computes_in != u.dtype else "") + f"): {why}. "
                "No comparison with one device can tell DDP's difference from that (see "
                f"{page_url(noise.FACTOR.page)})")
    if verdict.unexplained:
        names = ", ".join(f"{d['name']} ({d['max_abs_diff']:.3g})" for d in verdict.largest_differences)
        what = (f"more than {FLOOR_RATIO:g}x the floor after every fix" if not verdict.gradient_within
                else f"every step from one device's weights matches it, but after {u.steps_text} DDP with every fix "
                     f"is {verdict.trajectory_ratio:.3g}x the {u.steps}-step floor: something the single steps do "
                     "not carry (the optimizer's state, the module's own counters)")
        where = localise.describe((verdict.localised or {}).get("optimizers") or [], u.yardstick)
        return (f"- unexplained: not one of the known factors ({what})"
                + (f"; every step from one device's weights, {where}" if where else "")
                + f"; the parameters and buffers that differ most after {u.steps_text}: {names}")
    if not verdict.within_floor:
        manual = [_name(f["factor"]) for f in verdict.findings
                  if f["exposed"] and not f["automatic_fix"] and not f.get("follows")]
        first = ((verdict.whole_step or {}).get("differences") or [None])[0]
        if first is not None and verdict.gradient_within:
            where = (f"DDP's gradient is one device's, but its step first differs in the {first['part']} at step "
                     f"{first['step']}; not within {FLOOR_RATIO:g}x the floor after the automatic fixes")
        elif verdict.gradient_within and verdict.trajectory_within:
            where = (f"the rest of the step is one device's (each part within {FLOOR_RATIO:g}x its floor), but the "
                     "draws no fix keys to a sample are the same on every rank")
        else:
            where = f"not within {FLOOR_RATIO:g}x the floor after the automatic fixes"
        return (f"- not passed: {where}; exposed, and only a change in your code fixes it: {', '.join(manual)} "
                "(see the fix above; rerun the audit after it to see whether it accounts for the whole difference)")
    bite = [_name(f["factor"]) for f in verdict.findings if f["bites"]]
    judged = "the update, " if (verdict.whole_step or {}).get("update_judged", True) else ""
    another = [_name(k) for k in verdict.exit_why if k in _factors()]
    if another:  # the fixes close it, but DDP as the user runs it trains another model
        return (f"- not passed as you run it: {', '.join(another)} "
                f"change{'s' if len(another) == 1 else ''} the model DDP trains (the fix above is the change); "
                f"with the fixes, DDP computes one device's whole step at every step: the gradient, the learning "
                f"rate, {judged}the buffers and every rank's parameters, each within {FLOOR_RATIO:g}x its floor")
    two = ("in two parts: with the draws named above made alike in both runs, " if verdict.unkeyed_draws
           else "")
    return (f"- passed{',' if two else ':'} {two}with the fixes, DDP computes one device's whole step at every step: "
            f"the gradient, the learning rate, {judged}the buffers and every rank's parameters, "
            f"each within {FLOOR_RATIO:g}x its floor"
            + (f"; the factors whose fix makes that difference: {', '.join(bite)}" if bite
               else "; none of the exposed factors changes the gradient here")
            + ("; and the draws differ across ranks, independent as one device's rows are" if two else ""))


def _render_trajectory(verdict: Verdict, u: _Units) -> str:
    """The free-running K steps: DDP with every fix judged against the K-step floor, Lightning's defaults as context."""
    judged = verdict.trajectory_ratio
    return (f"- after {u.steps_text}, each run on its own, the largest "
            f"""{ {'parameters': 'parameter', 'buffers': 'buffer'}.get(verdict.trajectory_kind,
                                                                       'parameter or buffer')} """
            "difference to one device (parameters and buffers each against their own floor): "
            f"DDP with every fix {verdict.divergence_fixed:.3g}"
            + ("" if judged is None else
               f" ({judged:.3g}x the {u.steps}-step floor: one device with the samples permuted, "
               f"{verdict.trajectory_floor:.3g}"
               + (f", or one rounding unit of the largest value, {verdict.trajectory_unit:.3g}, if larger"
                  if verdict.trajectory_unit is not None else "")
               + f"; more than {TRAJECTORY_RATIO:g}x would be another trajectory, not rounding carried over)")
            + "".join(f"; {b} left out (a permutation rewrites it: judged step by step)"
                      for b in verdict.trajectory_left_out or [])
            + f"; with Lightning's defaults {verdict.divergence_default:.3g} (what the factors above change)")

