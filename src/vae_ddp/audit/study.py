"""``vae-ddp audit``: train the user's module on one device and with DDP, attribute the difference.

From the same seed (same initial weights), the same global batch and the same number of
optimizer steps, through Lightning's own ``Trainer`` and ``DDPStrategy``, in one process tree
(see [`vae_ddp.audit.run`][vae_ddp.audit.run]: the one-device runs in a process beside the N DDP
ranks, all forks of one process on CPU):

1. ``single``: one device, every fix that applies on one device on (the single-device
   global batches of the sampler fix, the global-batch noise) — the reference; it records its
   weights θ_k at the start of every step ([`StepProbe`][vae_ddp.probes.StepProbe]);
2. ``floor-1`` … ``floor-4``: one device started at every step from the reference's θ_k, the
   samples inside each batch permuted (the same loss, another summation order; each draw its
   own permutation): ``||g_floor - g_single|| / ||g_single||`` per step is what rounding alone does;
   ``other-batch``: one device started at every step from the reference's weights of the step
   before, so that it takes another batch at the same weights: the batch-to-batch gradient
   noise each factor's contribution is set against (as the site's factor table does);
3. ``ddp+fixed-forced``: N ranks, every fix on, started at every step from the same θ_k: its
   all-reduced gradient against one device's, per step — the verdict. Every step starts from
   the same weights, so no difference is carried over and amplified by later steps;
4. context, compared after all the steps (a chaotic yardstick: Adam carries a last-bit
   difference into every later step): ``ddp`` (Lightning's defaults, its
   [`DDPAudit`][vae_ddp.audit.callback.DDPAudit] findings tell which factors the run is exposed
   to), ``ddp+fixed`` and ``permuted`` (one device, samples permuted);
5. ``ddp-<factor>``: every fix but one, every step from one device's weights: the factor's
   contribution, in the same units as the verdict (the ablation);
6. ``single-eval`` and ``ddp+fixed-eval``, only when the one-process check flagged the loss's
   reduction: the same teacher-forced comparison in eval mode (no dropout, BatchNorm's running
   statistics), under the real process group: it clears the flag of a loss that reduces over
   the global batch through collectives, or confirms it.

DDP passes (exit 0) when its largest per-step gradient difference is within 2x the largest
floor draw (the rule of ``vae-ddp equivalence``). When the floor itself is more than rounding
(random draws that do not follow their sample, e.g. ``torch.rand`` in ``training_step``), the
audit says so and does not judge (exit 1); above the floor after every fix with no factor left
to fix in the user's code, the difference is "unexplained: not one of the known factors"
(exit 1) and the parameters that differ most are named.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from vae_ddp.audit import effects, loader_draws, localise, whole_step
from vae_ddp.audit.draws import draws_verdict
from vae_ddp.audit.spec import AuditRun, failed_marker
from vae_ddp.fixes import noise, registry
from vae_ddp.audit import exit_rule
from vae_ddp.fixes.factor import AUDIT_OWN, audit_factor, page_url
from vae_ddp.probes import per_step_differences
from vae_ddp.harness.permutation import FLOOR_FACTOR
from vae_ddp.harness.launch import Job, RunFailed, launch
from vae_ddp.harness.table import format_table
from vae_ddp.outputs import drop_tensors, own_folder, result_set

__all__ = ["audit", "render", "write_report", "earlier_report", "FLOOR_RATIO", "FLOOR_DRAWS", "ROUNDING_EPS"]

#: DDP with every fix passes when its largest per-step gradient difference (from the same
#: weights) is at most this multiple of the one-device floor: the rule of ``vae-ddp equivalence``.
FLOOR_RATIO = FLOOR_FACTOR

#: Draws of the one-device floor, each with its own permutation of the samples of every batch.
FLOOR_DRAWS = 4

#: The floor is rounding when it is at most this many machine epsilons of the dtype (one step's
#: floor on this project's VAE: 1-2 eps, float32 and float64); above it, one device's step is
#: not a function of the weights and the batch alone, and DDP cannot be judged against it.
ROUNDING_EPS = 1e4

#: After K free steps DDP with every fix is judged against one device with the samples permuted
#: (the K-step floor): a largest parameter or buffer difference more than this many times that
#: floor (or one rounding of the largest value, if larger) is another trajectory, not rounding
#: carried over. Wide on purpose: a last-bit difference grows with every step, in both runs alike.
TRAJECTORY_RATIO = 1e3

def _factors() -> tuple[str, ...]:
    """The factor keys of [`vae_ddp.fixes.registry`][vae_ddp.fixes.registry] in their order, then the audit's own."""
    return tuple(f.key for f in registry.factors()) + tuple(AUDIT_OWN)


def _clean(key: str) -> str:
    """What the table says when nothing of factor ``key`` is seen (the factor's own words)."""
    return audit_factor(key).clean


def _name(key: str) -> str:
    """The factor's name (one name everywhere); an unknown key as it is."""
    try:
        return audit_factor(key).name
    except KeyError:
        return key


def _page(key: str) -> str:
    return audit_factor(key).page


def _diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _largest(a: dict, b: dict, n: int = 3) -> list[dict]:
    """The ``n`` parameters or buffers of two saved states that differ most."""
    d = sorted(((float((a[k].double() - b[k].double()).abs().max()), k) for k in a), reverse=True)[:n]
    return [{"name": k, "max_abs_diff": v} for v, k in d]


def audit(base: AuditRun, out_dir: Path, static: Optional[list[dict]] = None, progress: bool = True,
          notes: Optional[list[str]] = None) -> dict:
    """Run the audit of ``base`` (``devices`` = the DDP world size N) and write
    ``out_dir/audit.json`` and ``out_dir/tables.md`` ([`write_report`][vae_ddp.audit.study.write_report]:
    an earlier report there stays until this one is whole; ``out_dir`` is best absolute, the
    user's code may change the working folder). The runs' logs and findings stay under
    ``out_dir/runs``; the tensors they saved (each run's final weights and per-step gradients,
    several GB for a ResNet-18 in float64) are deleted once compared, whether the audit ends or fails.

    Returns:
        ``{"devices", "steps", "dtype", "method": "teacher-forced", "floor", "floor_draws",
        "grad_steps", "ratio_to_floor", "none_fixed", "deterministic", "within_floor",
        "trajectory_floor", "divergence_default", "divergence_fixed", "batch_noise",
        "batch_noise_steps", "findings": [{"factor", "exposed", "evidence", "contribution", "bites",
        "left_after_fixes", "fixed_alone", "vs_batch_noise", "automatic_fix", "fix", "page", "effect"}],
        "unexplained": bool, "largest_differences": [...], "notes": [str], "effect", "effect_rows"}``.
        ``effect`` (of a finding; at the top, of Lightning's defaults as a whole): what the factor changes
        over ``effect_rows`` global batches, a dict with the keys ``kind``, ``bias``, ``bias_ci``,
        ``variance_ratio``, ``variance_ratio_ci``, ``quantity`` and ``rows`` (see
        ``vae_ddp.audit.effects``), None where not measured (a factor not exposed, logging;
        ``--effect_batches 0``); a factor only the user's code fixes: DDP with every automatic fix on,
        what is left for that code. The verdict: ``grad_steps`` (per
        optimizer step, ``||g_ddp - g_single|| / ||g_single||`` from the same weights),
        ``floor`` (the largest of ``floor_draws``, the same for one device with the samples
        permuted) and ``ratio_to_floor`` (the largest DDP step over ``max(floor, eps)``);
        ``deterministic``: the floor is rounding (at most ``ROUNDING_EPS`` machine epsilons).
        ``contribution``: the largest per-step relative gradient difference from one device (the
        same comparison) with every fix on but this factor's (None where there is no automatic
        fix or the factor changes no gradient, e.g. logging); ``bites``: above 2x the larger of
        the floor and DDP's own with every fix (None, "not separable", when it is not and DDP
        with every fix is itself more than 2x the floor). ``fixed_alone``: the same with only
        this factor's fix on, beside ``none_fixed``, with no fix (None where the floor is not
        rounding or no automatic fix applies). Context, not the verdict: ``divergence_*`` and
        ``trajectory_floor``, the largest parameter or buffer difference after ``steps`` steps.
        ``buffers_check``: None, or where the buffers row stood beside draws no automatic fix serves,
        ``{"rows", "closed", "buffer_ratio", "gradient"}`` of one device and DDP trained again with those
        draws keyed to the samples (``closed``: the row then ``follows`` ``rows``); ``localised["sync_grads"]``:
        None, or where a gather without gradient was seen, DDP's gradient with ``sync_grads=True`` forced
        there (``{"steps", "relative", "ratio", "within"}``, relative to one device's and over the floor).
        ``notes``: ``notes`` given (what the one-process checks could not do), flags the DDP runs
        cleared, and what the runs noticed beside the factors, e.g. DataLoader workers forked
        from a multithreaded process, which the audit started with ``forkserver`` instead.
    """
    runs_dir = Path(out_dir) / "runs"
    try:
        return _audit(base, Path(out_dir), static, progress, notes)
    finally:
        drop_tensors(runs_dir)


def _audit(base: AuditRun, out_dir: Path, static: Optional[list[dict]], progress: bool,
           notes: Optional[list[str]]) -> dict:
    """Plan the runs, measure them in one launch, judge what they measured; write and print the report."""
    notes = list(notes or [])
    if base.accelerator == "cpu" and (base.trainer or {}).get("precision") == "16-mixed":
        # Lightning 2.x (AcceleratorConnector) runs 16-mixed as bf16-mixed on a CPU, with a warning:
        # the audit compares what runs, in bfloat16's rounding unit
        base = base.replace(trainer=dict(base.trainer, precision="bf16-mixed"))
        notes.append("--trainer.precision 16-mixed runs as bf16-mixed on a CPU (Lightning 2.x: float16 autocast is "
                     "not supported there), so the audit compares bf16-mixed, in bfloat16's rounding unit")
    plan = _plan(base, out_dir, static or [])
    if progress:
        for spec in plan.one_device + plan.ddp:
            print(f"[audit] {spec.label}: {spec.devices} process(es), fixes: {', '.join(spec.fixes) or 'none'}"
                  f"{', samples permuted in each batch' if spec.permute else ''}"
                  f"{', each batch from the weights of the step before' if spec.lag else ''}"
                  f"{', every step from the one-device weights' if spec.teacher_forced else ''}", flush=True)
    result = _judge(plan, _measure(plan, out_dir / "runs"), notes or [])
    text = render(result)
    write_report(out_dir, result, text)
    print(text)
    if progress:
        print(f"[audit] report of this audit written to {out_dir / 'tables.md'} and {out_dir / 'audit.json'}",
              flush=True)
    return result


#: The report's files: replaced together ([`write_report`][vae_ddp.audit.study.write_report]).
REPORT = ("audit.json", "tables.md")


def write_report(out_dir: Path, result: dict, text: str) -> None:
    """``out_dir/audit.json`` (``result``) and ``out_dir/tables.md`` (``text``) in place of the
    earlier report's, as one set ([`result_set`][vae_ddp.outputs.result_set]): a kill at any
    moment leaves the earlier report whole or this one.

    Raises:
        vae_ddp.outputs.OutOfSpace: the file system is full (the earlier report stays).
    """
    with result_set(out_dir) as new:
        (new / "audit.json").write_text(json.dumps(result, indent=1))
        (new / "tables.md").write_text(text + "\n")


def earlier_report(out_dir: Path) -> Optional[str]:
    """The line that says an audit that did not finish left the earlier report in ``out_dir``
    (``audit.json`` and ``tables.md``, with the time they were written, UTC), or None when there is none."""
    import datetime

    files = [Path(out_dir) / name for name in REPORT]
    try:
        written = max(f.stat().st_mtime for f in files)
    except OSError:  # none, or not both: no earlier report
        return None
    when = datetime.datetime.fromtimestamp(written, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return (f"{files[1]} and {files[0].name} are not this audit's: they are the earlier report, of the audit that "
            f"wrote them at {when}, kept as they were")


@dataclass
class _Plan:
    """The audit's runs: ``one_device`` (the reference, the floor draws, another batch, the permuted
    free run, and the eval-mode reference when the loss reduction is asked again) and ``ddp`` (one
    launch of ``base.devices`` ranks), with what the judgement needs to know of them."""

    base: AuditRun
    fixes: list[str]
    one_device: list[AuditRun]
    ddp: list[AuditRun]
    lag: int  # optimizer steps between the weights and the batch of the other-batch run
    recheck: bool  # the one-process check flagged the loss reduction: asked again under DDP's process group
    attention: list[str]  # layers whose attention dropout no run can key to a sample (turned off)
    torch_draws: list[str]  # torch's random functions called in the step (keyed to the samples)
    static: list[dict]  # the one-process checks' findings
    items: bool = False  # the dataset draws in __getitem__ (keyed to the index; the ranks' draws measured)


def _plan(base: AuditRun, out_dir: Path, static: list[dict]) -> _Plan:
    n = base.devices
    # attention dropout no run can key to a sample: every compared run without it; torch's random
    # functions in the step: every compared run with them keyed to the samples (the second part, the
    # draws themselves, is judged from Lightning's defaults, which keep them as the user draws them)
    attention = [layer for f in static for layer in f.get("attention_layers", [])]
    torch_draws = [site for f in static for site in f.get("torch_draws", [])]
    # the dataset's draws in __getitem__ likewise: keyed to the index in every compared run, and
    # what the ranks' loaders draw for the same samples measured under Lightning's defaults
    items = any(f.get("loader_draws") == "dataset" for f in static)
    static = [f for f in static if not (f.get("attention_layers") or f.get("torch_draws")
                                        or f.get("loader_draws") == "dataset")]
    base = base.replace(dealt_to=n, attention_dropout=not attention, keyed_draws=bool(torch_draws), keyed_items=items)
    fixes = list(registry.audit_fixable())
    runs_dir = out_dir / "runs"
    for folder in (runs_dir, runs_dir / "one-device", runs_dir / "ddp"):
        own_folder(folder)  # before anything is deleted or written there
    steps_file = (runs_dir / "single-steps.pt").resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    # a previous audit's reference weights must not serve this one's runs; its report (audit.json,
    # tables.md) stays until this audit's is whole (write_report), and a failure says it is the earlier one
    for stale in (steps_file, failed_marker(steps_file)):
        stale.unlink(missing_ok=True)

    forced = dict(fixes=fixes, steps_file=str(steps_file), teacher_forced=True)
    # another batch at the same weights: batch k from θ of one optimizer step earlier
    lag = int(base.trainer.get("accumulate_grad_batches") or 1)
    one_device = [base.replace(label="single", devices=1, fixes=fixes, steps_file=str(steps_file)),
                  *(base.replace(label=f"floor-{k}", devices=1, permute=k, **forced)
                    for k in range(1, FLOOR_DRAWS + 1)),
                  base.replace(label="other-batch", devices=1, lag=lag, **forced),
                  base.replace(label="permuted", devices=1, fixes=fixes, permute=FLOOR_DRAWS + 1)]
    # The ablation (every fix but one, every step from one device's weights) runs in the same
    # launch for every fixable factor; only the factors found exposed below are reported (a
    # launch costs more than a few short runs). The teacher-forced runs go last: they wait for
    # the one-device run's weights.
    ddp = [base.replace(label="ddp", devices=n, fixes=[], attention_dropout=True, keyed_draws=False, keyed_items=False,
                        probe_items=items),
           base.replace(label="ddp+fixed", devices=n, fixes=fixes),
           base.replace(label="ddp+fixed-forced", devices=n, **forced),
           *(base.replace(label=f"ddp-{f}", devices=n, **dict(forced, fixes=[g for g in fixes if g != f]))
             for f in fixes),
           # and from the other end: no fix, then each fix alone (Lightning's defaults for the rest)
           base.replace(label="ddp-forced", devices=n, **dict(forced, fixes=[])),
           *(base.replace(label=f"ddp+{f}", devices=n, **dict(forced, fixes=[f])) for f in fixes)]
    # The one-process reduction check ran without a process group: a loss that reduces over the
    # global batch through collectives (an all-reduced item count, gathered embeddings) looks
    # per-rank there. Asked again where the collectives run: one device and DDP with every fix,
    # every step from the same weights, in eval mode as that check (no dropout, BatchNorm's
    # running statistics), so that nothing drawn or normalised in training mode is measured.
    recheck = any(f.get("recheck") for f in static)
    if recheck:
        one_device.append(base.replace(label="single-eval", devices=1, eval_mode=True, **forced))
        ddp.append(base.replace(label="ddp+fixed-eval", devices=n, eval_mode=True, **forced))
    more = effects.plan(base, fixes, str(steps_file))  # each factor's bias and noise ratio: many batches, last
    one_device, ddp = one_device + more[0], ddp + more[1]
    return _Plan(base, fixes, one_device, ddp, lag, recheck, attention, torch_draws, static, items)


class _Runs:
    """What the launch measured: ``one[label]`` and ``first[label]`` (one device's runs, DDP's) as
    ``(final state, run.json entry, folder)``."""

    def __init__(self, one: dict, first: dict) -> None:
        self.one, self.first = one, first

    def record(self, label: str) -> dict:
        """The run's [`StepProbe.record()`][vae_ddp.probes.StepProbe.record]."""
        run = self.one.get(label) or self.first[label]
        return torch.load(run[2] / f"{label}.steps.pt")

    def per_step(self, label: str, reference: str = "single") -> list[float]:
        """Per optimizer step, the run's gradient relative to ``reference``'s.

        Raises:
            RunFailed: the two runs' steps or gradients do not line up.
        """
        try:
            return per_step_differences(self.record(label)["grads"], self.record(reference)["grads"])
        except (ValueError, RuntimeError) as err:  # steps or gradients that do not line up
            raise RunFailed(f"run '{label}' cannot be compared with one device's step by step: {err}") from None

    def largest(self, label: str, reference: str = "single") -> float:
        return max(self.per_step(label, reference), default=0.0)


def _measure(plan: _Plan, runs_dir: Path) -> _Runs:
    """One launch: the one-device runs in a process forked beside the DDP ranks, all forks of one
    process that imported torch and Lightning once (most of a launch is those imports)."""
    where = {"one-device": runs_dir / "one-device", "ddp": runs_dir / "ddp"}
    launched = launch(Job({"one-device": plan.one_device, "ddp": plan.ddp}, together=True), runs_dir, quiet=True,
                      entry=[sys.executable, "-m", "vae_ddp.audit.run"])
    one, first = ({s.label: (torch.load(where[tag] / f"{s.label}.pt"), launched[tag][s.label], where[tag])
                   for s in specs}
                  for tag, specs in (("one-device", plan.one_device), ("ddp", plan.ddp)))
    if localise.SYNC_GRADS in launched["ddp"]:  # the ranks checked the sync_grads advice (a gather seen)
        first[localise.SYNC_GRADS] = (torch.load(where["ddp"] / f"{localise.SYNC_GRADS}.pt"),
                                      launched["ddp"][localise.SYNC_GRADS], where["ddp"])
    return _Runs(one, first)


def _gradient_verdict(plan: _Plan, runs: _Runs) -> dict:
    """The gradient, every step from one device's weights: DDP with every fix against one device,
    against the floor draws (the samples permuted) and one rounding unit; and the batch-to-batch
    noise the factors are set against."""
    base = plan.base
    floor_draws = [runs.per_step(f"floor-{k}") for k in range(1, FLOOR_DRAWS + 1)]
    one = runs.one
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


def _exposures(plan: _Plan, runs: _Runs, v: dict) -> tuple[dict, dict, list[str]]:
    """``(found, manual, cleared)``: the exposed factors (as the default DDP run's ``DDPAudit`` and
    the one-process checks saw them), those only the user's code fixes, and the notes of what the
    runs cleared (seen, but with every fix the gradient is one device's)."""
    info = runs.first["ddp"][1]
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
    user_code = {f["factor"]: f for f in info["findings"] + runs.first["ddp+fixed"][1]["findings"] if f.get("manual")}
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


def _judge(plan: _Plan, runs: _Runs, notes: list[str]) -> dict:
    """The result (see [`audit`][vae_ddp.audit.study.audit]) from what the runs measured."""
    base, n, one, first = plan.base, plan.base.devices, runs.one, runs.first
    v = _gradient_verdict(plan, runs)
    single, default, fixed = one["single"][0], first["ddp"][0], first["ddp+fixed"][0]
    found, manual, cleared = _exposures(plan, runs, v)
    ablated = [f for f in plan.fixes if f in found and f not in manual]
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
    trajectory_floor, div_fixed, trajectory_unit, trajectory_ratio = (free[k] for k in ("floor", "divergence", "unit",
                                                                                         "ratio"))
    within = v["grad_within"] and not (step or {}).get("differences") and trajectory_ratio <= TRAJECTORY_RATIO
    items = loader_draws.verdict(first["ddp"][1].get("loader_draws")) if plan.items else None
    draws = (draws_verdict(plan.attention, plan.torch_draws, first["ddp"][1]["findings"], items)
             if plan.attention or plan.torch_draws or items else None)
    if draws is not None and draws["repeated"]:  # else independent draws of one distribution: the line says so
        manual[noise.FACTOR.key] = found[noise.FACTOR.key] = draws["finding"]
        within = False
    unexplained = v["deterministic"] and not within and not manual
    rows = _rows(found, manual, contributions, alone, v, none_fixed)
    # the findings behind the rows: the default DDP run's that an automatic fix removes, and those left for the
    # user's code (not the ones the runs cleared: seen, but making no difference here)
    seen_findings = [f for f in first["ddp"][1]["findings"] if not f.get("manual")] + list(manual.values())
    for row in rows:  # what each exposed factor does to the model DDP trains (vae_ddp.audit.exit_rule)
        row["mechanism"] = exit_rule.mechanism(row["factor"], seen_findings) if row["exposed"] else None
    measured = effects.measure(runs.record, base, plan.fixes, {  # the same step within 2x the rounding floor
        "gradient": FLOOR_RATIO * v["yardstick"],
        "buffers": FLOOR_RATIO * (step or {}).get("buffer_floor", v["yardstick"])},
        # a gradient every fix leaves different, in the user's code alone: each factor's run carries it too
        residual=(("buffers",) if "buffers" in (step or {}).get("findings", {}) else ())
        + (("gradient",) if local is not None and (local["findings"] or left_unnamed) else ()))
    effects.attach(rows, measured, {f.key: f.ablated_with or f.fixed_by for f in registry.factors()
                                    if f.ablated_with or f.fixed_by})
    for row in rows:  # rank 0's gradient is not DDP's step when every rank steps on its own: not measured
        if row["factor"] == "parameters" and (local or {}).get("unreduced") and row["exposed"]:
            row["effect"] = None
        if row.get("follows"):  # what every fix leaves is the rows it follows from: not its own effect
            row["effect"] = None
    findings = sorted(rows, key=_rank)
    result = {"devices": n, "steps": base.steps, "dtype": base.dtype, "method": "teacher-forced",
              "floor": v["floor"], "floor_draws": v["floor_draws"], "grad_steps": v["grad_steps"],
              "ratio_to_floor": v["ratio"], "none_fixed": none_fixed, "batch_noise": v["batch_noise"],
              "batch_noise_steps": v["noise_steps"],
              "deterministic": v["deterministic"], "within_floor": within, "unexplained": unexplained,
              "trajectory_floor": trajectory_floor, "divergence_default": div_default, "divergence_fixed": div_fixed,
              "trajectory_ratio": trajectory_ratio, "trajectory_within": trajectory_ratio <= TRAJECTORY_RATIO,
              "trajectory_unit": trajectory_unit, "trajectory_kind": free["kind"],
              "trajectory_left_out": free["left_out"],
              "gradient_within": v["grad_within"], "rounding_unit": v["unit"],
              "unkeyed_draws": None if draws is None else {k: val for k, val in draws.items() if k != "finding"},
              "whole_step": None if step is None else {k: val for k, val in step.items() if k != "findings"},
              "reduction_under_ddp": v["reduction_ddp"],
              "buffers_check": buffers_check,
              "localised": None if local is None else {k: val for k, val in local.items() if k != "findings"},
              "effect": measured.get("defaults"), "effect_rows": (measured.get("defaults") or {}).get("rows"),
              "findings": findings, "largest_differences": _largest(fixed, single) if unexplained else [],
              # as the user named them (path/to/file.py:Class, not the module the audit made of the file)
              "model": dict(base.model, class_path=shown_name(base.model, base.model_file)),
              "data": dict(base.data, class_path=shown_name(base.data, base.data_file)),
              "global_batch_size": base.global_batch_size, "trainer": base.trainer,
              "model_name": shown_name(base.model, base.model_file), "data_name": shown_name(base.data, base.data_file)}
    seen = [note for rs in (one, first) for _, i, _ in rs.values() for note in i.get("notes", [])]
    result["notes"] = list(dict.fromkeys(list(notes) + cleared + seen))
    exit_ = exit_rule.decide(result)
    result["exit_code"], result["exit_why"] = exit_["code"], exit_["why"]
    return result


#: The audit's check of a buffers row beside draws its fixes do not serve: one device and DDP with every
#: fix and those draws keyed to the samples, every step from one device's weights (``_buffers_follow``).
KEYED = ("single+keyed", "ddp+fixed-forced+keyed")


def _buffers_follow(plan: _Plan, runs: "_Runs", v: dict, found: dict, manual: dict) -> Optional[dict]:
    """Whether the buffers that differ with every fix follow from the draws no automatic fix serves
    (torch's random functions in the step, named under ``noise``; per-rank BatchNorm statistics, when
    exposed, are fixed in every compared run): one device and DDP are trained once more, every fix on
    and those draws keyed to the samples ([`KeyedTorchDraws`][vae_ddp.audit.draws.KeyedTorchDraws]), and
    their buffers compared as [`whole_step.compare`][vae_ddp.audit.whole_step.compare] does (against the
    floor draws' buffers). Only where the deterministic step's ``buffers`` row stands beside such draws
    and the compared runs did not key them already; else None (nothing run).

    Returns:
        ``{"rows": [factor keys], "closed": bool (the buffers within 2x their floor at every step),
        "buffer_ratio": float (the largest, over the floor), "gradient": float (the largest relative
        difference of DDP's gradient from one device's)}``; when ``closed``, ``found`` and ``manual``'s
        ``buffers`` row says it follows from ``rows`` (``follows``, ``mechanism: "follows"``, no fix of its own).

    Raises:
        RunFailed: a run failed, or its steps do not line up with one device's.
    """
    draws = manual.get(noise.FACTOR.key)
    if not v["deterministic"] or draws is None or draws.get("unkeyed") or plan.base.keyed_draws:
        return None
    forced = next(s for s in plan.ddp if s.label == localise.RANKS_GRADS)
    one = forced.replace(label=KEYED[0], devices=1, keyed_draws=True)
    ddp = forced.replace(label=KEYED[1], keyed_draws=True)
    out = runs.first["ddp"][2].parent / "buffers-check"
    for folder in (out, out / "one-device", out / "ddp"):
        own_folder(folder)
    launch(Job({"one-device": [one], "ddp": [ddp]}, together=True), out, quiet=True,
           entry=[sys.executable, "-m", "vae_ddp.audit.run"])
    single = torch.load(out / "one-device" / f"{KEYED[0]}.steps.pt")
    keyed = torch.load(out / "ddp" / f"{KEYED[1]}.steps.pt")
    floors = [runs.record(f"floor-{k}") for k in range(1, FLOOR_DRAWS + 1)]
    try:
        step = whole_step.compare(keyed, single, floors, v["eps"], v["unit"] if v["unit"] > v["eps"] else 0.0)
        gradient = max(per_step_differences(keyed["grads"], single["grads"]), default=0.0)
    except (ValueError, RuntimeError) as err:
        raise RunFailed(f"run '{KEYED[1]}' cannot be compared with one device's step by step: {err}") from None
    rows = [noise.FACTOR.key] + [k for k in ("batchnorm",) if k in found and k not in manual]
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


def _localised(runs: "_Runs", v: dict, n: int, found: dict, manual: dict) -> tuple[Optional[dict], bool]:
    """What every fix leaves of the gradient, optimizer by optimizer ([`localise`][vae_ddp.audit.localise]),
    where the step is deterministic and the gradient not within its floor: its findings join ``found`` and
    ``manual`` (a reduction finding merged with the one already there). Returns the localisation (None
    where not run) and whether nothing else was left for the user's code before it."""
    if not v["deterministic"] or v["grad_within"]:
        return None, False
    synced = runs.record(localise.SYNC_GRADS) if localise.SYNC_GRADS in runs.first else None
    try:
        local = localise.judge(runs.record(localise.RANKS_GRADS), runs.record("single"),
                               runs.first[localise.RANKS_GRADS][1].get("gathers") or [], v["yardstick"], n, synced)
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


def rounding_unit(dtype: str, precision: Optional[str] = None) -> float:
    """The least relative difference the audit counts: the machine epsilon of the dtype the step
    computes in, bfloat16's or float16's under ``bf16-mixed``/``16-mixed`` autocast (Lightning's
    precision names), else the parameters' ``dtype``."""
    if str(precision or "").startswith("bf16"):
        return torch.finfo(torch.bfloat16).eps
    if str(precision or "").startswith("16"):
        return torch.finfo(torch.float16).eps
    return torch.finfo(torch.float64 if dtype == "float64" else torch.float32).eps


def _whole_step(runs: "_Runs", n: int, eps: float, grad_within: bool, unit: float) -> dict:
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


def render(result: dict) -> str:
    """The Markdown the audit prints and writes: the ranked table, the verdict, the context."""
    u = _Units(result)
    lines = _render_table(result, u) + [""] + effects.render(result, _name)
    lines += [""] * bool(lines[-1]) + _render_measures(result, u)
    lines.append(_render_verdict(result, u))
    lines.append(_render_trajectory(result, u))
    lines += [f"- note: {n}" for n in result.get("notes", [])]
    return "\n".join(lines)


class _Units:
    """What the report's lines share: the rounding unit (of the dtype the step computes in), the
    floor it sets, the number of steps in words."""

    def __init__(self, result: dict) -> None:
        self.dtype = result["dtype"]
        self.precision = (result.get("trainer") or {}).get("precision")
        self.eps = rounding_unit(self.dtype, self.precision)
        self.computes_in = {torch.finfo(torch.bfloat16).eps: "bfloat16", torch.finfo(torch.float16).eps: "float16"}.get(
            self.eps, self.dtype) if self.precision else self.dtype
        self.yardstick = max(result["floor"], self.eps)
        self.steps = result["steps"]
        self.steps_text = f"{self.steps} step" + ("" if self.steps == 1 else "s")

    def vs_floor(self, v: float) -> str:  # short: the table fits 100 columns
        return f"{v:.3g} ({v / self.yardstick:.2g}x floor)"


def _render_table(result: dict, u: _Units) -> list[str]:
    """The ranked table, what its columns mean, and each factor's evidence and fix."""
    def contribution(f: dict) -> str:
        if f.get("follows"):
            return "follows from " + ", ".join(_name(k) for k in f["follows"])
        c, left = f["contribution"], f.get("left_after_fixes")
        if left is not None:
            return f"your code: {u.vs_floor(left).replace(' (', ' left (', 1)}"
        if c is None:
            return "needs your code" if f["exposed"] and not f["automatic_fix"] else ""
        verdict = {True: "", False: ": does not bite", None: ": not separable"}[f["bites"]]
        return u.vs_floor(c) + verdict

    def vs_noise(f: dict) -> str:
        v = f.get("vs_batch_noise")
        return "" if v is None else f"{v:.2g}x"

    def alone(f: dict) -> str:
        a, none = f.get("fixed_alone"), result.get("none_fixed")
        if a is None or none is None:
            return ""
        return (f". With only this fix on: {u.vs_floor(a)}; with no fix: {none:.3g}"
                + (": its fix changes nothing here, from either end" if f.get("fix_changes_nothing") else ""))

    rows = [[_name(f["factor"]), "yes" if f["exposed"] else "no", contribution(f), vs_noise(f)]
            for f in result["findings"]]
    batch_noise = result.get("batch_noise")
    title = (f"Audit of {result.get('model_name') or result['model']['class_path']} "
             f"on {result['devices']} devices vs one, "
             f"global batch {result['global_batch_size']}, {u.steps_text}, {u.dtype}"
             + "".join(f", {k}={v}" for k, v in (result.get("trainer") or {}).items()))
    lines = [format_table(["factor", "exposed", "contribution", "vs another batch"], rows, title=title), "",
             "contribution: with every fix on but this factor's, every step started from one device's weights, "
             "the largest relative difference of DDP's gradient from one device's (for a factor that needs your "
             "code: what is left with every automatic fix on). vs another batch: that difference over the one "
             "another batch makes to one device's gradient at the same weights ("
             + (f"{batch_noise:.3g} relative, the mean over {len(result['batch_noise_steps'])} steps)"
                if batch_noise is not None
                else "not measured: it needs two optimizer steps)")
             + ": below 1, the factor moves the gradient less than the batch-to-batch noise of training. "
             + "Evidence and fix, per factor:", ""]
    return lines + [f"- {_name(f['factor'])}: {f['evidence']}" + (f". Fix: {f['fix']}" if f["fix"] else "") + alone(f)
                    + f" (see {page_url(f['page'])})" for f in result["findings"]]


def _render_measures(result: dict, u: _Units) -> list[str]:
    """The gradient against its floor, the rest of the step against theirs, the two parts of attention dropout."""
    lines = [f"- every step from one device's weights: DDP with every fix differs from one device's gradient by "
             f"{max(result['grad_steps'], default=0.0):.3g} relative at most ({result['ratio_to_floor']:.3g}x the "
             f"floor); the floor, one device with the samples inside each batch permuted "
             f"({len(result['floor_draws'])} draws): {result['floor']:.3g}"
             + (f" (below one machine epsilon of {u.computes_in}, {u.eps:.3g}, which the ratio takes instead)"
                if result["floor"] < u.eps else "")]
    step = result.get("whole_step")
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
    draws = result.get("unkeyed_draws")
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


def _render_verdict(result: dict, u: _Units) -> str:
    """One line: not judged, unexplained, not passed (what differs first, what only the user's code
    fixes) or passed."""
    if not result["deterministic"]:
        unserved = any(f["factor"] == noise.FACTOR.key and f["exposed"] and not f["automatic_fix"]
                       for f in result["findings"])
        why = ("the training step draws random numbers that do not follow their sample, from torch's global "
               "generator, which the audit's fix does not serve (see Random streams per rank)" if unserved else
               "most likely random draws that do not follow their sample (NumPy's or Python's random in "
               "training_step, say; the audit keys torch's random functions, dropout masks and a `noise` attribute "
               "to the samples itself), or a loss that depends "
               "on the order of the samples")
        return (f"- not judged: permuting the samples inside each batch changes one device's gradient by "
                f"{result['floor']:.3g} relative, more than rounding ({ROUNDING_EPS:g} eps of {u.dtype}"
                + (f", 10 eps of {u.computes_in}" if u.computes_in != u.dtype else "") + f"): {why}. "
                "No comparison with one device can tell DDP's difference from that (see "
                f"{page_url(noise.FACTOR.page)})")
    if result["unexplained"]:
        names = ", ".join(f"{d['name']} ({d['max_abs_diff']:.3g})" for d in result["largest_differences"])
        what = (f"more than {FLOOR_RATIO:g}x the floor after every fix" if not result.get("gradient_within", False)
                else f"every step from one device's weights matches it, but after {u.steps_text} DDP with every fix "
                     f"is {result['trajectory_ratio']:.3g}x the {u.steps}-step floor: something the single steps do "
                     "not carry (the optimizer's state, the module's own counters)")
        where = localise.describe((result.get("localised") or {}).get("optimizers") or [], u.yardstick)
        return (f"- unexplained: not one of the known factors ({what})"
                + (f"; every step from one device's weights, {where}" if where else "")
                + f"; the parameters and buffers that differ most after {u.steps_text}: {names}")
    if not result["within_floor"]:
        manual = [_name(f["factor"]) for f in result["findings"]
                  if f["exposed"] and not f["automatic_fix"] and not f.get("follows")]
        first = ((result.get("whole_step") or {}).get("differences") or [None])[0]
        if first is not None and result.get("gradient_within"):
            where = (f"DDP's gradient is one device's, but its step first differs in the {first['part']} at step "
                     f"{first['step']}; not within {FLOOR_RATIO:g}x the floor after the automatic fixes")
        elif result.get("gradient_within") and result.get("trajectory_within", True):
            where = (f"the rest of the step is one device's (each part within {FLOOR_RATIO:g}x its floor), but the "
                     "draws no fix keys to a sample are the same on every rank")
        else:
            where = f"not within {FLOOR_RATIO:g}x the floor after the automatic fixes"
        return (f"- not passed: {where}; exposed, and only a change in your code fixes it: {', '.join(manual)} "
                "(see the fix above; rerun the audit after it to see whether it accounts for the whole difference)")
    bite = [_name(f["factor"]) for f in result["findings"] if f["bites"]]
    judged = "the update, " if (result.get("whole_step") or {}).get("update_judged", True) else ""
    another = [_name(k) for k in result.get("exit_why", []) if k in _factors()]
    if another:  # the fixes close it, but DDP as the user runs it trains another model
        return (f"- not passed as you run it: {', '.join(another)} "
                f"change{'s' if len(another) == 1 else ''} the model DDP trains (the fix above is the change); "
                f"with the fixes, DDP computes one device's whole step at every step: the gradient, the learning "
                f"rate, {judged}the buffers and every rank's parameters, each within {FLOOR_RATIO:g}x its floor")
    two = ("in two parts: with the draws named above made alike in both runs, " if result.get("unkeyed_draws")
           else "")
    return (f"- passed{',' if two else ':'} {two}with the fixes, DDP computes one device's whole step at every step: "
            f"the gradient, the learning rate, {judged}the buffers and every rank's parameters, "
            f"each within {FLOOR_RATIO:g}x its floor"
            + (f"; the factors whose fix makes that difference: {', '.join(bite)}" if bite
               else "; none of the exposed factors changes the gradient here")
            + ("; and the draws differ across ranks, independent as one device's rows are" if two else ""))


def _render_trajectory(result: dict, u: _Units) -> str:
    """The free-running K steps: DDP with every fix judged against the K-step floor, Lightning's defaults as context."""
    judged = result.get("trajectory_ratio")
    return (f"- after {u.steps_text}, each run on its own, the largest "
            f"""{ {'parameters': 'parameter', 'buffers': 'buffer'}.get(result.get('trajectory_kind'),
                                                                       'parameter or buffer')} """
            "difference to one device (parameters and buffers each against their own floor): "
            f"DDP with every fix {result['divergence_fixed']:.3g}"
            + ("" if judged is None else
               f" ({judged:.3g}x the {u.steps}-step floor: one device with the samples permuted, "
               f"{result['trajectory_floor']:.3g}"
               + (f", or one rounding unit of the largest value, {result['trajectory_unit']:.3g}, if larger"
                  if result.get("trajectory_unit") is not None else "")
               + f"; more than {TRAJECTORY_RATIO:g}x would be another trajectory, not rounding carried over)")
            + "".join(f"; {b} left out (a permutation rewrites it: judged step by step)"
                      for b in result.get("trajectory_left_out") or [])
            + f"; with Lightning's defaults {result['divergence_default']:.3g} (what the factors above change)")
