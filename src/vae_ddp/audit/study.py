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
   contribution, in the same units as the verdict (the ablation); ``ddp+<factor>``, that fix alone,
   beside ``ddp-forced``, no fix. A factor's runs (these two and its effect run) train only where the
   ``ddp`` run found it exposed, decided inside the same launch ([`vae_ddp.audit.run`][vae_ddp.audit.run]);
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

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Optional

# The stages, each in the module of its name: plan, measure, judge, the verdict and its rules, render. They
# stay importable from here; _audit calls _plan, _measure, _judge and render through this module.
from vae_ddp.audit.judge import judge as _judge
from vae_ddp.audit.judge import shown_name as shown_name
from vae_ddp.audit.measure import Measured as Measured
from vae_ddp.audit.measure import measure as _measure
from vae_ddp.audit.measure import watch as measure_watch
from vae_ddp.audit.plan import FLOOR_DRAWS as FLOOR_DRAWS
from vae_ddp.audit.plan import Plan as Plan
from vae_ddp.audit.plan import plan as _plan
from vae_ddp.audit.render import render as render
from vae_ddp.audit.spec import AuditRun
from vae_ddp.audit.verdict import FLOOR_RATIO as FLOOR_RATIO
from vae_ddp.audit.verdict import ROUNDING_EPS as ROUNDING_EPS
from vae_ddp.audit.verdict import TRAJECTORY_RATIO as TRAJECTORY_RATIO
from vae_ddp.audit.verdict import Verdict as Verdict
from vae_ddp.audit.verdict import rounding_unit as rounding_unit
from vae_ddp.outputs import drop_tensors, result_set

__all__ = ["audit", "render", "write_report", "earlier_report", "FLOOR_RATIO", "FLOOR_DRAWS", "ROUNDING_EPS"]


def audit(base: AuditRun, out_dir: Path, static: Optional[list[dict]] = None, progress: bool = True,
          notes: Optional[list[str]] = None) -> dict:
    """Run the audit of ``base`` (``devices`` = the DDP world size N) and write
    ``out_dir/audit.json`` and ``out_dir/tables.md`` ([`write_report`][vae_ddp.audit.study.write_report]:
    an earlier report there stays until this one is whole; ``out_dir`` is best absolute, the
    user's code may change the working folder). The runs' logs and findings stay under
    ``out_dir/runs``; the tensors they saved (each run's final weights and per-step gradients,
    several GB for a ResNet-18 in float64) are deleted once compared, whether the audit ends or fails.

    Returns:
        [`Verdict.to_dict()`][vae_ddp.audit.verdict.Verdict.to_dict] (``audit.json``'s content),
        ``{"devices", "steps", "dtype", "method": "teacher-forced", "floor", "floor_draws",
        "grad_steps", "ratio_to_floor", "none_fixed", "deterministic", "within_floor",
        "trajectory_floor", "divergence_default", "divergence_fixed", "batch_noise",
        "batch_noise_steps", "findings": [{"factor", "exposed", "evidence", "contribution", "bites",
        "left_after_fixes", "fixed_alone", "vs_batch_noise", "automatic_fix", "fix", "page", "effect"}],
        "unexplained": bool, "largest_differences": [...], "notes": [str], "effect", "effect_rows",
        "runs": [str]}`` (``runs``: the names of the runs trained, a factor's only where it is exposed).
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
    """Plan the runs ([`plan`][vae_ddp.audit.plan.plan]), measure them in one launch
    ([`measure`][vae_ddp.audit.measure.measure]), judge what they measured ([`judge`][vae_ddp.audit.judge.judge]);
    write and print the report ([`render`][vae_ddp.audit.render.render])."""
    notes = list(notes or [])
    if base.accelerator == "cpu" and (base.trainer or {}).get("precision") == "16-mixed":
        # Lightning 2.x (AcceleratorConnector) runs 16-mixed as bf16-mixed on a CPU, with a warning:
        # the audit compares what runs, in bfloat16's rounding unit
        base = base.replace(trainer=dict(base.trainer, precision="bf16-mixed"))
        notes.append("--trainer.precision 16-mixed runs as bf16-mixed on a CPU (Lightning 2.x: float16 autocast is "
                     "not supported there), so the audit compares bf16-mixed, in bfloat16's rounding unit")
    plan = _plan(base, out_dir, static or [])
    planned = len(plan.one_device) + len(plan.ddp)
    if progress:  # the plan in one line, then a line per run done (measure.watch), on stderr: stdout is the report
        _say(f"{planned} runs planned, {len(plan.one_device)} on one device beside {len(plan.ddp)} on "
             f"{base.devices} DDP ranks; a factor's runs train only where the first DDP runs see it exposed")
    with measure_watch(plan, out_dir / "runs", time.monotonic()) if progress else contextlib.nullcontext():
        measured = _measure(plan, out_dir / "runs")
    if progress:
        same = measured.same_runs
        _say(f"{len(measured.runs)} of {planned} planned runs trained (a "
             "factor's runs only where it is exposed)" + (f"; {len(same)} more are the same as one of them (they "
             "differ by fixes that change nothing here): " + ", ".join(f"{a} = {b}" for a, b in same.items())
             if same else ""))
    verdict = _judge(plan, measured, notes or [])
    text = render(verdict)
    result = verdict.to_dict()
    write_report(out_dir, result, text)
    print(text, flush=True)
    if progress:
        _say(f"report of this audit written to {out_dir / 'tables.md'} and {out_dir / 'audit.json'}")
    return result


def _say(line: str) -> None:
    """``[audit] LINE`` on stderr, where the audit says what it does (stdout holds the report)."""
    print(f"[audit] {line}", file=sys.stderr, flush=True)


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

