"""The six factors, one object each: name, docs page, what the fix changes, and an exposure check.

Every place that enumerates the fixes reads this registry instead of listing them:
``RunSpec.exact()`` and ``RunSpec.fixes()`` ([`RunSpec`][vae_ddp.studies.configs.RunSpec]), the
``Trainer`` of a run (``vae_ddp.studies.runner.build_trainer``), the ablation's and the
step-time benchmark's variants, the ``vae-ddp`` switches, and the runs of `vae-ddp audit`
(its fixes and its ablation: [`audit_parts`][vae_ddp.fixes.registry.audit_parts],
[`audit_fixable`][vae_ddp.fixes.registry.audit_fixable]). Adding a factor is one fix
module, one example, one page and one [`Factor`][vae_ddp.fixes.registry.Factor] passed to
[`register`][vae_ddp.fixes.registry.register] (plus, if it has a ``RunSpec`` switch, that field
with its ``Literal``/``bool`` type: the field is the typed flag).
[`exposures`][vae_ddp.fixes.registry.exposures]``(trainer, model, datamodule)`` runs every
factor's exposure check and returns ``{factor key: evidence}`` for the factors a run is exposed to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

__all__ = ["Factor", "FixParts", "factors", "get", "register", "unregister", "exposures", "switches", "audit_fixable",
           "audit_parts"]


@dataclass
class FixParts:
    """What a fix adds to a run: ``Trainer`` callbacks, plugins and keyword arguments, and
    keyword arguments of the LightningModule (module hooks) and of the datamodule (sampler)."""

    callbacks: list = field(default_factory=list)
    plugins: list = field(default_factory=list)
    trainer: dict = field(default_factory=dict)
    module: dict = field(default_factory=dict)
    datamodule: dict = field(default_factory=dict)
    #: ``prepare(datamodule, trainer)`` calls once the Trainer exists (the audit's sampler fix
    #: deals the user's loader in global batches; it needs the rank)
    prepare: list = field(default_factory=list)

    def merge(self, other: "FixParts") -> "FixParts":
        return FixParts(self.callbacks + other.callbacks, self.plugins + other.plugins,
                        {**self.trainer, **other.trainer}, {**self.module, **other.module},
                        {**self.datamodule, **other.datamodule}, self.prepare + other.prepare)


#: check(trainer, module, datamodule) -> why this run is exposed, or None when it is not.
Check = Callable[[Any, Any, Any], Optional[str]]


@dataclass(frozen=True)
class Factor:
    """One factor that makes DDP on N devices differ from one device.

    Attributes:
        key: short identifier (``noise``, ``batchnorm``, ...).
        name: its name wherever the site names it (the field's term): the factor page's title
            and ``nav`` entry in ``mkdocs.yml``, the tables that list the factors (Home's
            factor table, the recipe's). The only place the name is written: the rest read it
            (``tests/test_names.py`` checks the title and the ``nav`` entry against it).
        page: its docs page, relative to ``docs/``.
        changes: what its fix changes, in words (Trainer arguments, callbacks, plugins,
            sampler, module hooks).
        field: the ``RunSpec`` field that switches its fix (None: fixed by another factor's switch).
        default: that field's value under Lightning's defaults.
        fixed: the value ``RunSpec.exact()`` sets.
        choices: every non-default value (each is a variant of the step-time benchmark).
        parts: ``parts(spec, seed) -> FixParts`` of the fix for the field's current value.
        audit_parts: ``audit_parts(run) -> FixParts``: the fix `vae-ddp audit` applies to a
            user's LightningModule and datamodule (``run``: an
            [`AuditRun`][vae_ddp.audit.spec.AuditRun]); None: the audit has no automatic fix
            for it (it reports it, or another factor's fix covers it).
        check: ``check(trainer, module, datamodule) -> str | None``: why the given run is exposed.
        fixed_by: key of the factor whose switch fixes this one (when ``field`` is None).
        off_label: the ablation's name for the run with this fix off (default ``"<key> fix off"``).
    """

    key: str
    name: str
    page: str
    changes: str
    check: Check
    field: Optional[str] = None
    default: Any = None
    fixed: Any = None
    choices: tuple = ()
    parts: Optional[Callable[[Any, int], FixParts]] = None
    audit_parts: Optional[Callable[[Any], FixParts]] = None
    fixed_by: Optional[str] = None
    off_label: str = ""

    @property
    def ablation_label(self) -> str:
        return self.off_label or f"{self.key} fix off"

    def is_on(self, spec: Any) -> bool:
        """Whether ``spec`` (a ``RunSpec``) has this factor's fix on."""
        return self.field is not None and getattr(spec, self.field) != self.default

    def label(self, spec: Any) -> str:
        """Short name of the fix as set in ``spec`` (``noise=global``, ``sync_bn``)."""
        return self.value_label(getattr(spec, self.field))

    def value_label(self, value: Any) -> str:
        """Short name of the switch at ``value`` (``noise=global``; a bool switch: its field)."""
        return self.field if isinstance(value, bool) else f"{self.field}={value}"


# --- checks -----------------------------------------------------------------------------------------

def _world(trainer: Any) -> int:
    return int(getattr(trainer, "world_size", 1) or 1)


def _check_noise(trainer, module, datamodule) -> Optional[str]:
    from vae_ddp.fixes.noise import PerRankSeed
    from vae_ddp.fixes.randomness import GlobalBatchRandomness  # GlobalBatchNoise is one

    n = _world(trainer)
    if n > 1 and not any(isinstance(cb, (PerRankSeed, GlobalBatchRandomness)) for cb in trainer.callbacks):
        return (f"{n} ranks seeded alike draw the same random numbers in training_step (reparameterization "
                f"noise, dropout masks): add GlobalBatchRandomness (GlobalBatchNoise for the VAE) or PerRankSeed")
    return None


def _check_batchnorm(trainer, module, datamodule) -> Optional[str]:
    from torch.nn import SyncBatchNorm
    from torch.nn.modules.batchnorm import _BatchNorm

    from vae_ddp.fixes.batchnorm import GlobalBatchNorm

    n = _world(trainer)
    bns = [m for m in module.modules() if isinstance(m, _BatchNorm) and not isinstance(m, (SyncBatchNorm, GlobalBatchNorm))]
    if n > 1 and bns and getattr(trainer.strategy, "_layer_sync", None) is None:
        return (f"{len(bns)} BatchNorm layers normalise over the per-device batch: Trainer(sync_batchnorm=True) "
                f"on GPUs, plugins=[GlobalSyncBatchNorm()] on CPU")
    return None


def _uses_global_sampler(datamodule) -> bool:
    return getattr(datamodule, "sampler", None) == "global"


def _check_sampler(trainer, module, datamodule) -> Optional[str]:
    n = _world(trainer)
    if n > 1 and not _uses_global_sampler(datamodule):
        return ("Lightning's DistributedSampler deals its own permutation to the ranks interleaved: the global "
                "batch of step k is not one device's batch k; use GlobalBatchDistributedSampler")
    return None


def _check_reduction(trainer, module, datamodule) -> Optional[str]:
    n = _world(trainer)
    if n == 1 or datamodule is None or _uses_global_sampler(datamodule):
        return None
    if getattr(datamodule, "dataset_train", None) is None and hasattr(datamodule, "setup"):
        datamodule.setup("fit")
    size, b = len(datamodule.dataset_train), int(datamodule.batch_size)
    if size % n:
        return (f"{size} training samples on {n} ranks: DistributedSampler pads with {n - size % n} repeated "
                f"sample(s), counted twice in the mean")
    per_rank = size // n
    if per_rank % b and not getattr(datamodule, "drop_last", False):
        return (f"the last per-device batch has {per_rank % b} of {b} samples: the average of per-rank means "
                f"weights its samples more; drop incomplete global batches")
    return None


def _check_logging(trainer, module, datamodule) -> Optional[str]:
    if _world(trainer) > 1 and not getattr(module, "sync_dist_logging", False):
        return "self.log without sync_dist=True logs rank 0's share of the batch, not the global batch"
    return None


def _check_optimizer(trainer, module, datamodule) -> Optional[str]:
    if _check_noise(trainer, module, datamodule):
        return "Adam's second moment absorbs the extra gradient variance of the shared noise: fix the noise"
    return None


# --- what each fix adds ---------------------------------------------------------------------------

def _parts_noise(spec, seed: int) -> FixParts:
    from vae_ddp.fixes.noise import GlobalBatchNoise, PerRankSeed

    return FixParts(callbacks=[{"per_rank": PerRankSeed, "global": GlobalBatchNoise}[spec.noise](seed)])


def _parts_batchnorm(spec, seed: int) -> FixParts:
    from vae_ddp.fixes.batchnorm import GlobalSyncBatchNorm

    if spec.config != "ddp":
        return FixParts()
    if spec.accelerator == "gpu":
        return FixParts(trainer={"sync_batchnorm": True})  # torch.nn.SyncBatchNorm (GPU only)
    return FixParts(plugins=[GlobalSyncBatchNorm()])


def _parts_sampler(spec, seed: int) -> FixParts:
    return FixParts(trainer={"use_distributed_sampler": False}, datamodule={"sampler": spec.sampler})


def _parts_logging(spec, seed: int) -> FixParts:
    return FixParts(module={"sync_dist_logging": True})


# --- what the audit's fix adds to a user's run (vae_ddp.audit.run) --------------------------------

def _audit_noise(run) -> FixParts:
    from vae_ddp.fixes.randomness import GlobalBatchRandomness

    # dropout and drop-path layers, a `noise` attribute: drawn for the global batch
    return FixParts(callbacks=[GlobalBatchRandomness(run.seed)])


def _audit_batchnorm(run) -> FixParts:
    from vae_ddp.fixes.batchnorm import GlobalSyncBatchNorm

    if run.devices == 1:
        return FixParts()
    if run.accelerator == "gpu":
        return FixParts(trainer={"sync_batchnorm": True})  # torch.nn.SyncBatchNorm (GPU only)
    return FixParts(plugins=[GlobalSyncBatchNorm()])


def _audit_sampler(run) -> FixParts:
    from vae_ddp.fixes.sampler import deal_global_batches

    def prepare(datamodule, trainer) -> None:
        deal_global_batches(datamodule, run.global_batch_size, trainer.global_rank, run.devices, run.seed)

    return FixParts(trainer={"use_distributed_sampler": False}, prepare=[prepare])


_REGISTRY: dict[str, Factor] = {}


def register(factor: Factor) -> Factor:
    """Add ``factor`` (its ``key`` must be new); returns it."""
    if factor.key in _REGISTRY:
        raise ValueError(f"factor {factor.key!r} is already registered")
    _REGISTRY[factor.key] = factor
    return factor


def unregister(key: str) -> None:
    """Remove the factor ``key`` (tests register fakes and remove them)."""
    _REGISTRY.pop(key)


def factors() -> tuple[Factor, ...]:
    """Every registered factor, in registration order (the order of the docs)."""
    return tuple(_REGISTRY.values())


def get(key: str) -> Factor:
    return _REGISTRY[key]


def audit_fixable() -> tuple[str, ...]:
    """The keys of the factors `vae-ddp audit` fixes by itself (those with ``audit_parts``), in order."""
    return tuple(f.key for f in factors() if f.audit_parts is not None)


def audit_parts(run: Any) -> FixParts:
    """What the audit adds to ``run`` (an ``AuditRun``) for the fixes in ``run.fixes``."""
    parts = FixParts()
    for f in factors():
        if f.key in run.fixes and f.audit_parts is not None:
            parts = parts.merge(f.audit_parts(run))
    return parts


def switches() -> tuple[Factor, ...]:
    """The factors that have a ``RunSpec`` switch."""
    return tuple(f for f in factors() if f.field is not None)


def exposures(trainer: Any, module: Any, datamodule: Any = None) -> dict[str, str]:
    """Which factors a run is exposed to: ``{factor key: why}`` for each exposed one.

    Args:
        trainer: a ``pytorch_lightning.Trainer`` (its world size, callbacks, plugins).
        module: the ``LightningModule`` (its BatchNorm layers; ``sync_dist_logging`` if it has one,
            else logging is reported as exposed).
        datamodule: the ``LightningDataModule`` (its ``sampler``, ``batch_size`` and training set);
            may be set up (``setup("fit")``) to count the training samples.
    """
    out = {}
    for f in factors():
        why = f.check(trainer, module, datamodule)
        if why:
            out[f.key] = why
    return out


register(Factor(
    key="noise", name="Random streams per rank", page="factors/noise.md",
    changes="Trainer callback GlobalBatchNoise (global-batch noise, sliced by rank) or PerRankSeed (seed + rank)",
    check=_check_noise, field="noise", default="default", fixed="global", choices=("per_rank", "global"),
    parts=_parts_noise, audit_parts=_audit_noise, off_label="noise back to default"))
register(Factor(
    key="batchnorm", name="BatchNorm statistics", page="factors/batchnorm.md",
    changes="Trainer(sync_batchnorm=True) on GPUs; plugin GlobalSyncBatchNorm (a LayerSync) on CPU",
    check=_check_batchnorm, field="sync_bn", default=False, fixed=True, choices=(True,), parts=_parts_batchnorm,
    audit_parts=_audit_batchnorm, off_label="BatchNorm back to per-rank"))
register(Factor(
    key="sampler", name="Sampler and data order", page="factors/sampler.md",
    changes="datamodule sampler GlobalBatchDistributedSampler; Trainer(use_distributed_sampler=False)",
    check=_check_sampler, field="sampler", default="default", fixed="global", choices=("global",),
    parts=_parts_sampler, audit_parts=_audit_sampler, off_label="sampler back to DistributedSampler"))
register(Factor(
    key="reduction", name="Mean reduction", page="factors/reduction.md",
    changes="equal per-rank batches: incomplete global batches dropped by the sampler switch",
    check=_check_reduction, fixed_by="sampler"))
register(Factor(
    key="logging", name="Logging", page="factors/logging.md",
    changes="module hook: self.log(..., sync_dist=True, batch_size=len(x))",
    check=_check_logging, field="sync_dist_logging", default=False, fixed=True, choices=(True,),
    parts=_parts_logging, off_label="logging back to rank 0"))
register(Factor(
    key="optimizer", name="Optimizer (Adam)", page="factors/optimizer.md",
    changes="none of its own: fixing the noise removes it",
    check=_check_optimizer, fixed_by="noise"))
