"""The audit's first stage: which runs it trains ([`plan`][vae_ddp.audit.plan.plan] gives a
[`Plan`][vae_ddp.audit.plan.Plan]), before anything starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vae_ddp.audit import effects
from vae_ddp.audit.localise import RANKS_GRADS
from vae_ddp.audit.spec import DRAWS_LEFT, HAS_BUFFERS, LEFT, ONE_DEVICE, SEEN_FILE, AuditRun, failed_marker
from vae_ddp.fixes import noise, registry
from vae_ddp.outputs import own_folder

__all__ = ["Plan", "plan", "batch_lag", "FLOOR_DRAWS", "KEYED"]

#: Draws of the one-device floor, each with its own permutation of the samples of every batch.
FLOOR_DRAWS = 4

#: The check of a buffers row beside draws the audit's fixes do not serve (``judge._buffers_follow``): one
#: device and DDP with every fix and those draws keyed to the samples, every step from one device's weights.
KEYED = ("single+keyed", "ddp+fixed-forced+keyed")



@dataclass
class Plan:
    """The audit's first stage: its runs, ``one_device`` (the reference, the floor draws, another batch,
    the permuted free run, and the eval-mode reference when the loss reduction is asked again) and
    ``ddp`` (one launch of ``base.devices`` ranks), with what the judgement needs to know of them."""

    base: AuditRun
    """The user's run, as every compared run takes it (``dealt_to``, the draws keyed or turned off)."""
    fixes: list[str]
    """The keys of the factors the audit fixes by itself
    ([`registry.audit_fixable`][vae_ddp.fixes.registry.audit_fixable])."""
    one_device: list[AuditRun]
    """The one-device runs, one process beside the DDP ranks."""
    ddp: list[AuditRun]
    """The DDP runs, ``base.devices`` ranks each."""
    lag: int
    """Optimizer steps between the weights and the batch of the ``other-batch`` run (batches per step)."""
    recheck: bool
    """The one-process check flagged the loss's reduction: asked again under DDP's process group."""
    attention: list[str]
    """Layers whose attention dropout no run can key to a sample (turned off in every compared run)."""
    torch_draws: list[str]
    """Torch's random functions called in the step (keyed to the samples in every compared run)."""
    static: list[dict]
    """The one-process checks' findings the runs judge (those of the draws above taken out)."""
    items: bool = False
    """The dataset draws in ``__getitem__`` (keyed to the index; the ranks' draws measured)."""


def batch_lag(base: AuditRun) -> int:
    """Training batches per optimizer step of ``base`` (``accumulate_grad_batches``): the ``other-batch`` run's lag."""
    return int(base.trainer.get("accumulate_grad_batches") or 1)


def plan(base: AuditRun, out_dir: Path, static: list[dict]) -> Plan:
    """The runs that audit ``base`` (``devices`` = the DDP world size N) with ``static`` (the one-process
    checks' findings) into ``out_dir/runs``: that folder made the audit's own, and the reference weights
    of an earlier audit there deleted (its report stays until this one is whole).

    Raises:
        UserError: ``out_dir/runs`` or a folder in it is a link, not a folder, or not this user's (exit 2).
    """
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
    for folder in (runs_dir, runs_dir / ONE_DEVICE, runs_dir / "ddp"):
        own_folder(folder)  # before anything is deleted or written there
    steps_file = (runs_dir / "single-steps.pt").resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    # a previous audit's reference weights must not serve this one's runs; its report (audit.json,
    # tables.md) stays until this audit's is whole (write_report), and a failure says it is the earlier one
    seen_file = runs_dir.resolve() / SEEN_FILE  # what the deciding runs saw (audit.run), of this launch only
    for stale in (steps_file, failed_marker(steps_file), seen_file, failed_marker(seen_file)):
        stale.unlink(missing_ok=True)

    forced = dict(fixes=fixes, steps_file=str(steps_file), teacher_forced=True)
    # another batch at the same weights: batch k from θ of one optimizer step earlier
    lag = batch_lag(base)
    one_device = [base.replace(label="single", devices=1, fixes=fixes, steps_file=str(steps_file)),
                  *(base.replace(label=f"floor-{k}", devices=1, permute=k, **forced)
                    for k in range(1, FLOOR_DRAWS + 1)),
                  base.replace(label="other-batch", devices=1, lag=lag, **forced),
                  base.replace(label="permuted", devices=1, fixes=fixes, permute=FLOOR_DRAWS + 1)]
    # The ablation (every fix but one, every step from one device's weights) of a factor trains, in the
    # same launch, only when the first DDP run (Lightning's defaults, its DDPAudit findings: spec.DECIDING)
    # saw the factor exposed, as the judgement reports it (``if_seen``, decided in audit.run). The
    # teacher-forced runs go last: they wait for the one-device run's weights.
    ddp = [base.replace(label="ddp", devices=n, fixes=[], attention_dropout=True, keyed_draws=False, keyed_items=False,
                        probe_items=items),
           base.replace(label="ddp+fixed", devices=n, fixes=fixes),
           base.replace(label=RANKS_GRADS, devices=n, **forced),
           *(base.replace(label=f"ddp-{f}", devices=n, if_seen=[f], **dict(forced, fixes=[g for g in fixes if g != f]))
             for f in fixes),
           # and from the other end: no fix, then each fix alone (Lightning's defaults for the rest)
           base.replace(label="ddp-forced", devices=n, **dict(forced, fixes=[])),
           *(base.replace(label=f"ddp+{f}", devices=n, if_seen=[f], **dict(forced, fixes=[f])) for f in fixes)]
    # The one-process reduction check ran without a process group: a loss that reduces over the
    # global batch through collectives (an all-reduced item count, gathered embeddings) looks
    # per-rank there. Asked again where the collectives run: one device and DDP with every fix,
    # every step from the same weights, in eval mode as that check (no dropout, BatchNorm's
    # running statistics), so that nothing drawn or normalised in training mode is measured.
    recheck = any(f.get("recheck") for f in static)
    if recheck:
        one_device.append(base.replace(label="single-eval", devices=1, eval_mode=True, **forced))
        ddp.append(base.replace(label="ddp+fixed-eval", devices=n, eval_mode=True, **forced))
    # Buffers that differ with every fix beside draws no automatic fix serves (a GAN's z, the same on every
    # rank) may follow from those draws: one device and DDP with every fix and the draws keyed to the samples
    # tell (judge._buffers_follow). Trained where such draws can be seen: a one-process check's (and a module
    # with buffers), or the deciding DDP runs'; not where every compared run keys the draws already.
    # (last: the one-device process waits there for what the deciding DDP runs saw, audit.run)
    more = effects.plan(base, fixes, str(steps_file))  # each factor's bias and noise ratio: many batches, last
    # DDP with every fix measures the effect of what only the user's code fixes: trained where something may be
    # (a one-process check's finding or draws no run keys; the deciding runs', or a step with every fix the
    # judgement cannot pass: spec.LEFT)
    if not (static or attention or torch_draws or items):
        more = (more[0], [r.replace(if_seen=[LEFT]) if r.label == effects.FIXED else r for r in more[1]])
    one_device, ddp = one_device + more[0], ddp + more[1]
    if not base.keyed_draws:
        when = [HAS_BUFFERS] if any(f["factor"] == noise.FACTOR.key for f in static) else [DRAWS_LEFT]
        one_device.append(base.replace(label=KEYED[0], devices=1, keyed_draws=True, if_seen=when, **forced))
        ddp.append(base.replace(label=KEYED[1], devices=n, keyed_draws=True, if_seen=when, **forced))
    return Plan(base, fixes, one_device, ddp, lag, recheck, attention, torch_draws, static, items)

