"""The audit's verdict and its rules: the thresholds it judges by (``FLOOR_RATIO``, ``ROUNDING_EPS``,
``TRAJECTORY_RATIO``), the rounding unit of a step and [`Verdict`][vae_ddp.audit.verdict.Verdict], what
[`judge`][vae_ddp.audit.judge.judge] gives and ``audit.json`` holds."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

import torch

from vae_ddp.fixes import registry
from vae_ddp.fixes.factor import AUDIT_OWN, audit_factor
from vae_ddp.harness.permutation import FLOOR_FACTOR

__all__ = ["Verdict", "rounding_unit", "FLOOR_RATIO", "ROUNDING_EPS", "TRAJECTORY_RATIO"]

#: DDP with every fix passes when its largest per-step gradient difference (from the same
#: weights) is at most this multiple of the one-device floor: the rule of ``vae-ddp equivalence``.
FLOOR_RATIO = FLOOR_FACTOR


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


def rounding_unit(dtype: str, precision: Optional[str] = None) -> float:
    """The least relative difference the audit counts: the machine epsilon of the dtype the step
    computes in, bfloat16's or float16's under ``bf16-mixed``/``16-mixed`` autocast (Lightning's
    precision names), else the parameters' ``dtype``."""
    if str(precision or "").startswith("bf16"):
        return torch.finfo(torch.bfloat16).eps
    if str(precision or "").startswith("16"):
        return torch.finfo(torch.float16).eps
    return torch.finfo(torch.float64 if dtype == "float64" else torch.float32).eps


@dataclass(kw_only=True)
class Verdict:
    """The audit's third stage: what the runs of a [`Measured`][vae_ddp.audit.measure.Measured] say,
    the content of ``audit.json`` ([`to_dict`][vae_ddp.audit.verdict.Verdict.to_dict], its keys in the
    order of these fields). Relative differences are ``||a - b|| / ||b||`` (floats, no unit); a ratio is
    a difference over its floor. The fields with a default may be absent from an older ``audit.json``
    ([`from_dict`][vae_ddp.audit.verdict.Verdict.from_dict] gives them the value the report assumes)."""

    devices: int
    """The DDP world size N."""
    steps: int
    """Optimizer steps of every run."""
    dtype: str
    """The parameters' dtype, ``"float32"`` or ``"float64"``."""
    method: str = "teacher-forced"
    """How the gradient is compared: every step from one device's weights."""
    floor: float
    """The largest relative gradient difference of the floor draws (one device, the samples of each batch
    permuted), over every draw and step."""
    floor_draws: list[list[float]]
    """Per draw (``FLOOR_DRAWS``), per optimizer step: the draw's relative gradient difference."""
    grad_steps: list[float]
    """Per optimizer step: DDP with every fix against one device, relative gradient difference."""
    ratio_to_floor: float
    """The largest of ``grad_steps`` over ``max(floor, rounding_unit)``."""
    none_fixed: Optional[float] = None
    """The same comparison as ``grad_steps`` with no fix, its largest; None where the floor is not rounding."""
    batch_noise: Optional[float] = None
    """The mean of ``batch_noise_steps``; None with a single optimizer step."""
    batch_noise_steps: list[float]
    """Per optimizer step but the first: how far another batch moves one device's gradient at the same
    weights (relative)."""
    deterministic: bool
    """The floor is rounding (at most ``ROUNDING_EPS`` machine epsilons, or 10 rounding units of a reduced
    precision); else nothing is judged."""
    within_floor: bool
    """With every fix, DDP's whole step (gradient, rest of the step, trajectory, draws) is within its floors."""
    unexplained: bool
    """Deterministic, not within the floor, and nothing left for the user's code: not one of the known factors."""
    trajectory_floor: float
    """After ``steps`` free steps, the largest parameter or buffer difference of one device with the samples
    permuted (absolute)."""
    divergence_default: float
    """After ``steps`` free steps, Lightning's default DDP against one device: the largest absolute
    parameter or buffer difference."""
    divergence_fixed: float
    """The same, DDP with every fix (as ``trajectory`` judges it: parameters and buffers each against their floor)."""
    trajectory_ratio: Optional[float] = None
    """``divergence_fixed`` over the trajectory's floor."""
    trajectory_within: bool = True
    """``trajectory_ratio`` is at most ``TRAJECTORY_RATIO``."""
    trajectory_unit: Optional[float] = None
    """One rounding unit of the largest value, where it is the trajectory's floor; else None."""
    trajectory_kind: Optional[str] = None
    """``"parameters"`` or ``"buffers"``: which set ``trajectory_ratio``."""
    trajectory_left_out: list[str] = field(default_factory=list)
    """The buffers the trajectory leaves to the step-by-step comparison (a permutation rewrites them)."""
    gradient_within: bool = False
    """Deterministic and ``ratio_to_floor`` at most ``FLOOR_RATIO``."""
    rounding_unit: Optional[float] = None
    """The machine epsilon of the dtype the step computes in
    ([`rounding_unit`][vae_ddp.audit.verdict.rounding_unit])."""
    unkeyed_draws: Optional[dict] = None
    """Draws no run can key to a sample as the user's code makes them (``attention``, ``torch``, ``dataset``,
    ``repeated``, ...; ``vae_ddp.audit.draws``); None where there are none."""
    whole_step: Optional[dict] = None
    """[`whole_step.compare`][vae_ddp.audit.whole_step.compare]'s dict of DDP with every fix (plus
    ``update_judged`` and ``gradient_scale``); None where the floor is not rounding."""
    reduction_under_ddp: Optional[dict] = None
    """``{"grad_steps", "ratio_to_floor"}`` of the eval-mode pair, when the one-process check flagged the
    loss's reduction; else None."""
    buffers_check: Optional[dict] = None
    """None, or where the buffers row stood beside draws no automatic fix serves, ``{"rows", "closed",
    "buffer_ratio", "gradient"}`` of one device and DDP trained again with those draws keyed to the
    samples (``closed``: the row then ``follows`` ``rows``)."""
    localised: Optional[dict] = None
    """Where DDP's gradient with every fix is not within its floor: ``{"optimizers", "unreduced", "gathers"}``
    ([`vae_ddp.audit.localise`][vae_ddp.audit.localise]), and ``"sync_grads"``: None, or where a gather
    without gradient was seen, DDP's gradient with ``sync_grads=True`` forced there (``{"steps", "relative",
    "ratio", "within"}``, relative to one device's and over the floor); else None."""
    effect: Optional[dict] = None
    """What Lightning's defaults as a whole change over ``effect_rows`` global batches (``kind``, ``bias``,
    ``bias_ci``, ``variance_ratio``, ``variance_ratio_ci``, ``quantity``, ``rows``); None where not measured."""
    effect_rows: Optional[int] = None
    """Global batches the effects are measured over; None where not measured."""
    findings: list[dict]
    """One row per factor (the registry's, then the audit's own), in the table's order: ``factor``,
    ``exposed``, ``evidence``, ``contribution``, ``bites``, ``left_after_fixes``, ``fixed_alone``,
    ``fix_changes_nothing``, ``vs_batch_noise``, ``automatic_fix``, ``fix``, ``page``, ``mechanism``,
    ``effect``."""
    largest_differences: list[dict]
    """Where unexplained: the parameters or buffers that differ most after ``steps`` steps,
    ``{"name", "max_abs_diff"}``; else empty."""
    model: dict = field(default_factory=dict)
    """The model's ``class_path`` (as the user named it) and ``init_args``."""
    data: dict = field(default_factory=dict)
    """The data's ``class_path`` (as the user named it) and ``init_args``."""
    global_batch_size: Optional[int] = None
    """Samples per optimizer step over every rank (one device's batch)."""
    trainer: Optional[dict] = None
    """The ``Trainer`` arguments the runs took (``precision``, ``gradient_clip_val``, ...)."""
    model_name: Optional[str] = None
    """The model class as the user named it (``path/to/file.py:Class`` or a dotted path)."""
    data_name: Optional[str] = None
    """The data class as the user named it."""
    notes: list[str] = field(default_factory=list)
    """What the one-process checks could not do, the flags the DDP runs cleared, what the runs noticed."""
    exit_code: int = 0
    """0 passed, 1 not ([`exit_rule.decide`][vae_ddp.audit.exit_rule.decide])."""
    exit_why: list[str] = field(default_factory=list)
    """The factor keys whose mechanism changes the model DDP trains, then what else makes ``exit_code`` 1."""
    runs: list[str] = field(default_factory=list)
    """The names of the runs the audit trained (one device's, then DDP's, each in the order they trained): a
    factor's ablation and effect runs only where it is exposed; empty in an older ``audit.json``."""
    same_runs: dict[str, str] = field(default_factory=dict)
    """The planned runs not trained because they differ from a run in ``runs`` only by fixes that changed
    nothing in this model (``Audit.idle``: no BatchNorm layer, no draw the noise fix serves), ``{name: the
    name of that run}``: its results are theirs."""

    def to_dict(self) -> dict:
        """``audit.json``'s content: every field, in their order (a new dict; the values themselves are
        this verdict's, not copies)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "Verdict":
        """The verdict of ``d`` (``audit.json``'s content, or [`to_dict`][vae_ddp.audit.verdict.Verdict.to_dict]'s):
        ``Verdict.from_dict(d).to_dict() == d`` for a whole one.

        Raises:
            TypeError: ``d`` lacks a field without a default, or has a key that is no field.
        """
        return cls(**d)
