"""The audit's exit code: does DDP, *as the user runs it*, train one device's model?

One rule for every factor (unit-tested in ``tests/audit/test_exit_rule.py``; stated in the README,
``vae-ddp audit -h`` and the audit page); what each factor's mechanism is, its fix module declares
([`Audit.mechanism`][vae_ddp.fixes.factor.Audit]):

- **1** for a difference shown by its mechanism, whatever the statistical power: the same draws on
  every rank (``noise``), per-rank statistics (``batchnorm``), a loss reduced otherwise than over the
  global batch or coupling samples across ranks (``reduction`` in the user's code), a stream that
  gives every rank the same batches or a batch that is not the global batch's chunk (``sampler``
  findings marked ``mechanism: "another model"``), a gradient that is k/N of one device's, a learning
  rate or update, buffers or parameters that part (the audit's own rows) -- even where one of the
  audit's fixes closes it: the fix is then the advice;
- **1** where the audit could not judge (the floor is not rounding) or DDP with every fix is not
  within 2x its floor (a difference no fix closes);
- **0** where DDP computes one device's step, or differs only in which samples or independent draws
  it takes from one device's distribution (Lightning's shuffling ``DistributedSampler``, its padding
  of the last batch), in what it plots (``logging``), or in what follows from another row
  (``optimizer``: Adam's step sizes under shared noise, named by ``noise``; ``buffers`` that the audit
  measured to follow from draws no automatic fix serves, a finding marked ``mechanism: "follows"``).

The effect sizes (a bias, a noise ratio) are what each cause costs, shown beside it; they do not
decide the code.
"""

from __future__ import annotations

__all__ = ["ANOTHER_MODEL", "SAME_DISTRIBUTION", "PLOT", "mechanism", "decide", "apart"]

ANOTHER_MODEL = "another model"
#: The mechanisms of an exit code 0: other samples or independent draws of one device's distribution, what is logged.
SAME_DISTRIBUTION = "same distribution"
PLOT = "plot"


def mechanism(factor: str, findings: list[dict]) -> str:
    """What an exposed factor does to the model DDP trains: a finding's own ``mechanism`` first (a
    sampler whose stream gives every rank the same batches; the reduction's padding by Lightning's
    ``DistributedSampler``, which only repeats samples), ``ANOTHER_MODEL`` where any finding says so,
    else the factor's declared one ([`Audit.mechanism`][vae_ddp.fixes.factor.Audit], in its fix module)."""
    from vae_ddp.fixes.factor import audit_factor

    marked = [f["mechanism"] for f in findings if f.get("factor") == factor and f.get("mechanism")]
    if marked:
        return ANOTHER_MODEL if ANOTHER_MODEL in marked else marked[0]
    return audit_factor(factor).audit.mechanism


def decide(result: dict) -> dict:
    """``{"code": 0 | 1, "why": [str]}`` for an audit result (``study.audit``'s dict: ``deterministic``,
    ``within_floor``, ``findings`` rows with ``factor``, ``exposed``, ``mechanism``; ``apart``, the parts of
    the step with every fix that are not within 2x their floors, in words, where known): ``why`` lists the
    keys of the factors whose mechanism changes the model DDP trains, then what else makes it 1, naming those
    parts (a gradient within its floor is never said to be out of it)."""
    if not result.get("deterministic", False):
        return {"code": 1, "why": ["not judged: one device's own floor is not rounding"]}
    why = [f["factor"] for f in result.get("findings", []) if f.get("exposed") and f.get("mechanism") == ANOTHER_MODEL]
    if not result.get("within_floor", False):
        apart = result.get("apart") or []
        why.append("with every fix, DDP's step is not within 2x its floor" + (f": {', '.join(apart)}" if apart else ""))
    return {"code": 1 if why else 0, "why": why}


def apart(gradient_within: bool, ratio: float, differences: "list[dict] | None", trajectory_ratio: float,
          steps: int) -> list[str]:
    """The parts of DDP's step with every fix that are not within 2x their floors, in words, for ``decide``'s
    ``apart``: the gradient (``ratio``: its largest per-step difference over the floor), the first part of the
    whole step that differs (``differences``: ``whole_step.compare``'s, each with ``part`` and ``step``), the
    parameters after ``steps`` steps (``trajectory_ratio`` above ``verdict.TRAJECTORY_RATIO``)."""
    from vae_ddp.audit.verdict import TRAJECTORY_RATIO

    first = (differences or [None])[0]
    return ([f"the gradient, {ratio:.3g}x its floor"] if not gradient_within else []) \
        + ([f"the {first['part']} at step {first['step']}"] if first else []) \
        + ([f"the parameters after {steps} steps, {trajectory_ratio:.3g}x their floor"]
           if trajectory_ratio > TRAJECTORY_RATIO else [])
