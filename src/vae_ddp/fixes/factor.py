"""What a factor is: the objects a fix module declares beside its fix, and the store they go in.

Each fix module, named by its factor's key (``noise``, ``batchnorm``, ``sampler``, ``reduction``,
``logging``, ``optimizer``), declares one [`Factor`][vae_ddp.fixes.factor.Factor] as ``FACTOR``: its name
and page, what its fix adds to a run ([`FixParts`][vae_ddp.fixes.factor.FixParts]), the static
exposure check, and the checks [`DDPAudit`][vae_ddp.audit.callback.DDPAudit] runs during a real
fit (``watch``: one function per Lightning hook, each returning
[`Finding`][vae_ddp.fixes.factor.Finding]s). [`vae_ddp.fixes.registry`][vae_ddp.fixes.registry]
finds them (every module of ``vae_ddp.fixes`` that declares one) and keeps them in the order of
the docs (``position``); everything else reads the registry.

This module imports no fix module (the fix modules import it), so the imports go one way:
``registry`` → fix modules → ``factor``. The helpers at the end are what the ``watch``
checks read from a running fit (loaders, samplers, generator states, values gathered over the
ranks).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

__all__ = ["Factor", "Switch", "Audit", "AUDIT_OWN", "audit_factor", "FixParts", "Finding", "CannotTell", "Seen",
           "HOOKS", "register", "unregister", "factors", "get",
           "batch_tensors", "cast_batch", "chunk_batch", "loader_list", "samplers", "rng_states", "gather_ints",
           "gather_objects", "gather_digest", "docs_url", "page_url"]


@dataclass
class FixParts:
    """What a fix adds to a run: ``Trainer`` callbacks, plugins and keyword arguments, and
    keyword arguments of the LightningModule (module hooks) and of the datamodule (sampler)."""

    callbacks: list = field(default_factory=list)
    plugins: list = field(default_factory=list)
    trainer: dict = field(default_factory=dict)
    module: dict = field(default_factory=dict)
    datamodule: dict = field(default_factory=dict)
    #: ``loader(dataloader, strategy) -> DataLoader`` for each training ``DataLoader``, applied
    #: where Lightning lets a strategy wrap the loaders (``Strategy.process_dataloader``, after
    #: its own sampler injection; the strategy knows the rank): how the audit's sampler fix deals
    #: the user's loader in global batches without touching the user's datamodule
    loaders: list = field(default_factory=list)

    def merge(self, other: "FixParts") -> "FixParts":
        return FixParts(self.callbacks + other.callbacks, self.plugins + other.plugins,
                        {**self.trainer, **other.trainer}, {**self.module, **other.module},
                        {**self.datamodule, **other.datamodule}, self.loaders + other.loaders)


#: check(trainer, module, datamodule) -> why this run is exposed, or None when it is not.
Check = Callable[[Any, Any, Any], Optional[str]]

#: The Lightning hooks at which ``DDPAudit`` runs the factors' ``watch`` checks, in the order
#: of a fit: ``train_start`` (once), ``train_batch_start`` (every training batch: a watch that
#: gathers over the ranks limits itself to the first few), ``train_batch_end`` (the first
#: training batch only), ``validation_batch_end`` (every validation batch but the sanity
#: check's) and ``validation_epoch_end`` (the first validation epoch after the sanity check).
HOOKS = ("train_start", "train_batch_start", "train_batch_end", "validation_batch_end", "validation_epoch_end")


@dataclass
class Seen:
    """What a ``watch`` check sees at a hook of a DDP fit (world size > 1).

    Attributes:
        trainer: the running ``pytorch_lightning.Trainer``.
        module: its ``LightningModule``.
        batch: the hook's batch (``train_batch_*`` and ``validation_batch_end``), else None.
        state: this factor's own dict for the fit (kept from hook to hook: what one hook
            saw that a later one compares with).
    """

    trainer: Any
    module: Any
    batch: Any = None
    state: dict = field(default_factory=dict)


#: watch(seen) -> the findings at that hook (an empty list when nothing is seen).
Watch = Callable[[Seen], list]


@dataclass(frozen=True)
class Switch:
    """The switch of a factor's fix in this project's runs: a typed field of
    [`RunSpec`][vae_ddp.harness.configs.RunSpec] (one ``vae-ddp`` flag).

    Attributes:
        field: the ``RunSpec`` field.
        default: its value under Lightning's defaults.
        fixed: the value ``RunSpec.exact()`` sets.
        choices: every non-default value (each is a variant of the step-time benchmark).
        parts: ``parts(spec, seed) -> FixParts`` of the fix for the field's current value.
        off_label: the ablation's name for the run with this fix off (default ``"<key> fix off"``).
    """

    field: str
    default: Any
    fixed: Any
    choices: tuple = ()
    parts: Optional[Callable[[Any, int], FixParts]] = None
    off_label: str = ""


@dataclass(frozen=True)
class Audit:
    """What `vae-ddp audit` and [`DDPAudit`][vae_ddp.audit.callback.DDPAudit] do with a factor.

    Attributes:
        parts: ``parts(run) -> FixParts``: the fix the audit applies to a user's LightningModule
            and datamodule (``run``: an [`AuditRun`][vae_ddp.audit.spec.AuditRun]); None: no
            automatic fix (it is reported, or another factor's fix covers it).
        watch: ``{hook: watch(seen) -> list[Finding]}``: what ``DDPAudit`` checks in a real DDP
            fit, per hook of ``vae_ddp.fixes.factor.HOOKS``.
        before: ``before(model, datamodule, batches, world_size) -> list[Finding]``: what the
            audit checks in one process before any training, on a few global batches
            (``manual=True``: no fix the audit applies removes what it finds); it raises
            [`CannotTell`][vae_ddp.fixes.factor.CannotTell] when it cannot tell, saying why.
        ablated_with: key of the factor whose fix the audit's ablation undoes to measure this one
            (its fix removes this factor too), when this one has no fix of its own in the audit.
        clean: what the audit's table says when nothing of this factor is seen.
        mechanism: what the factor, once seen, does to the model DDP trains, for the audit's exit
            code ([`exit_rule`][vae_ddp.audit.exit_rule]): ``"another model"`` (the default: exit 1
            even where the audit's fix closes it), ``"same distribution"`` (other samples or
            independent draws of one device's distribution), ``"plot"`` (what is logged) or
            ``"follows"`` (a consequence of another factor, which that factor's row decides); a
            ``Finding`` may say otherwise for itself (``details={"mechanism": ...}``).
        idle: ``idle(trainer, module) -> bool``, asked on rank 0 after the audit's DDP run with every fix
            (``ddp+fixed``; ``trainer`` its ``Trainer``, ``module`` the user's LightningModule): True
            where ``parts`` changed nothing in that run (no layer it swaps, no draw it serves), so that the
            audit's runs that differ only by this fix compute the same and one trains for both; None: never.
    """

    parts: Optional[Callable[[Any], FixParts]] = None
    watch: Mapping[str, Watch] = field(default_factory=dict)
    before: Optional[Callable[[Any, Any, list, int], list]] = None
    ablated_with: Optional[str] = None
    clean: str = "not detected"
    mechanism: str = "another model"
    idle: Optional[Callable[[Any, Any], bool]] = None


#: The titles of the pages the audit links that are not a factor's (a factor's page is titled by its name).
PAGE_TITLES = {"audit.md": "Audit your own model", "recipe.md": "The recipe: DDP that matches one device",
               "index.md": "Why doesn't DDP reproduce one device?"}
#: Each factor's page and its name, noted as the factor is made.
_TITLES: dict[str, str] = {}


@dataclass(frozen=True)
class Factor:
    """One factor that makes DDP on N devices differ from one device, declared in parts: who it
    is (``key``, ``name``, ``page``, ``position``, ``changes``, ``check``), how this project's runs
    switch its fix ([`Switch`][vae_ddp.fixes.factor.Switch], or ``fixed_by``) and what the audit
    does with it ([`Audit`][vae_ddp.fixes.factor.Audit]). The parts' attributes read as the
    factor's own (``factor.field``, ``factor.watch``, ``factor.audit_parts`` ...).

    Attributes:
        key: short identifier (``noise``, ``batchnorm``, ...), the name of its fix module.
        name: its name wherever the site names it (the field's term): the factor page's title
            and nav entry (the site's hook writes the nav from the registry), the tables that list
            the factors. The only place the name is written (``tests/test_names.py`` checks the
            title and the ``nav`` entry against it).
        page: its docs page, relative to ``docs/``.
        changes: what its fix changes, in words (Trainer arguments, callbacks, plugins,
            sampler, module hooks).
        check: ``check(trainer, module, datamodule) -> str | None``: why the given run is exposed.
        switch: the ``RunSpec`` field that switches its fix (None: another factor's switch fixes it).
        fixed_by: key of the factor whose switch fixes this one (when ``switch`` is None).
        audit: what the audit applies, checks and says.
        position: its place in the order of the docs (the site's tables and nav, the ablation's
            runs, ``RunSpec.fixes()``): [`factors`][vae_ddp.fixes.factor.factors] sorts by it,
            then by registration.

    Raises:
        ValueError: a ``watch`` hook that is not one of ``HOOKS`` (the message names the factor).
    """

    key: str
    name: str
    page: str
    changes: str
    check: Check
    switch: Optional[Switch] = None
    fixed_by: Optional[str] = None
    audit: Audit = dataclasses.field(default_factory=Audit)
    position: int = 1000

    field = property(lambda self: self.switch and self.switch.field)
    default = property(lambda self: self.switch and self.switch.default)
    fixed = property(lambda self: self.switch and self.switch.fixed)
    choices = property(lambda self: self.switch.choices if self.switch else ())
    parts = property(lambda self: self.switch and self.switch.parts)
    audit_parts = property(lambda self: self.audit.parts)
    watch = property(lambda self: self.audit.watch)
    before = property(lambda self: self.audit.before)
    ablated_with = property(lambda self: self.audit.ablated_with)
    clean = property(lambda self: self.audit.clean)

    def __post_init__(self) -> None:
        unknown = set(self.watch) - set(HOOKS)
        if unknown:
            raise ValueError(f"factor {self.key!r}: watch hooks {sorted(unknown)} are not among {HOOKS}")
        _TITLES.setdefault(self.page, self.name)  # its page is titled by its name (page_title)

    @property
    def ablation_label(self) -> str:
        return (self.switch and self.switch.off_label) or f"{self.key} fix off"

    def is_on(self, spec: Any) -> bool:
        """Whether ``spec`` (a ``RunSpec``) has this factor's fix on."""
        return self.switch is not None and getattr(spec, self.field) != self.default

    def label(self, spec: Any) -> str:
        """Short name of the fix as set in ``spec`` (``noise=global``, ``sync_bn``)."""
        return self.value_label(getattr(spec, self.field))

    def value_label(self, value: Any) -> str:
        """Short name of the switch at ``value`` (``noise=global``; a bool switch: its field)."""
        return self.field if isinstance(value, bool) else f"{self.field}={value}"


_REGISTRY: dict[str, Factor] = {}


def register(factor: Factor) -> Factor:
    """Add ``factor`` (its ``key`` must be new); returns it.

    Raises:
        ValueError: a factor with this key is registered already.
    """
    if factor.key in _REGISTRY:
        raise ValueError(f"factor {factor.key!r} is already registered")
    _REGISTRY[factor.key] = factor
    return factor


def unregister(key: str) -> None:
    """Remove the factor ``key`` (tests register fakes and remove them)."""
    _REGISTRY.pop(key)


def factors() -> tuple[Factor, ...]:
    """Every registered factor, in the order of the docs (``position``, then registration)."""
    return tuple(sorted(_REGISTRY.values(), key=lambda f: f.position))  # sorted() is stable


def get(key: str) -> Factor:
    """The factor ``key``. Raises ``KeyError`` when none is registered under it."""
    return _REGISTRY[key]


#: The audit's own checks beside the registered factors, declared as factors with no fix module,
#: switch or site page of their own (so not in the registry): the parts of the whole step
#: ([`vae_ddp.audit.whole_step`][vae_ddp.audit.whole_step]) and parameters that differ across
#: ranks. ``{key: Factor}``, in the order of the audit's table.
AUDIT_OWN = {f.key: f for f in (
    Factor(key, name, page, changes="nothing: only the user's code changes it", check=lambda *run: None,
           audit=Audit(clean=clean)) for key, name, page, clean in (
        ("gradient_scale", "Loss scaled by ranks", "audit.md", "the gradient is not one device's times the world size"),
        ("update", "Learning rate, update", "audit.md",
         "the same learning rate and update as one device at every step"),
        ("buffers", "Buffers after the step", "audit.md", "the same buffers as one device after every step"),
        ("parameters", "Parameters across ranks", "recipe.md",
         "the same parameters on every rank, at the start and after every step")))}


def audit_factor(key: str) -> Factor:
    """The factor ``key`` of the audit's table: the registry's or the audit's own (``AUDIT_OWN``).

    Raises:
        KeyError: neither has it."""
    return AUDIT_OWN[key] if key in AUDIT_OWN else _REGISTRY[key]


@dataclass
class Finding:
    """One factor a DDP run is exposed to, as ``DDPAudit`` reports it.

    Attributes:
        factor: the factor's key (``noise``, ``batchnorm``, ``sampler``, ``reduction``,
            ``logging``, ``optimizer``; ``parameters`` for the audit's own check, ``AUDIT_OWN``).
        evidence: what was seen, with the numbers (one line).
        fix: the change, plain Lightning/torch first, then the ``vae_ddp`` helper.
        page: the documentation page that measures the factor (relative to the site root); by
            default the factor's page (``recipe.md`` for a key that is no factor).
        manual: True when only a change in the user's code fixes it (none of the fixes the
            audit applies removes it), e.g. per-rank padding in a ``collate_fn``.
        details: what the audit's plan reads besides (the reduction's ``kind``; ``recheck``:
            asked again under DDP's process group).
    """

    factor: str
    evidence: str
    fix: str
    page: str = ""
    #: only a change in the user's code fixes it (no fix `vae-ddp audit` applies removes it)
    manual: bool = False
    details: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.page:
            self.page = audit_factor(self.factor).page if self._known() else "recipe.md"

    def _known(self) -> bool:
        return self.factor in _REGISTRY or self.factor in AUDIT_OWN

    def to_dict(self) -> dict:
        """``{"factor", "evidence", "fix", "page", "manual", **details}`` (what ``audit.json`` and
        the runs' ``run.json`` hold)."""
        return {"factor": self.factor, "evidence": self.evidence, "fix": self.fix, "page": self.page,
                "manual": self.manual, **self.details}

    def message(self) -> str:
        """``DDPAudit [Random streams per rank]: ... Fix: ... (see <site>/factors/noise/)``: the
        factor under its registry name (one name everywhere)."""
        name = audit_factor(self.factor).name if self._known() else self.factor
        return f"DDPAudit [{name}]: {self.evidence}. Fix: {self.fix} (see {page_url(self.page)})"


class CannotTell(Exception):
    """Raised by a factor's ``before`` check that cannot tell on the user's model (the message:
    what it could not tell, and why); the audit shows it as a note, and its DDP runs judge."""


@functools.cache
def docs_url() -> str:
    """The published site's address, from the installed package's ``Documentation`` project
    URL (``[project.urls]`` in ``pyproject.toml``, as ``importlib.metadata`` reads it), with a
    trailing ``/``; ``""`` when the package names none (an unpublished checkout)."""
    try:
        urls = importlib.metadata.metadata("vae-ddp").get_all("Project-URL") or []
    except importlib.metadata.PackageNotFoundError:
        return ""
    for entry in urls:
        label, _, url = entry.partition(",")
        if label.strip().lower() == "documentation" and url.strip():
            return url.strip().rstrip("/") + "/"
    return ""


def page_title(page: str) -> str:
    """The title of a docs page (relative to ``docs/``): :data:`PAGE_TITLES`'s (pages several rows share), else
    the name of the factor whose page it is (each ``Factor`` notes it when made), else the page's path
    (tests/fixes/test_registry.py checks them against the pages' headings)."""
    return PAGE_TITLES.get(page) or _TITLES.get(page, page)


def page_url(page: str) -> str:
    """Where a reader of the audit's output finds ``page`` (a docs page, relative to ``docs/``).

    ``factors/noise.md`` becomes ``<site>/factors/noise/`` (MkDocs' directory URLs;
    ``index.md`` is the site's root) under [`docs_url`][vae_ddp.fixes.factor.docs_url]; when the
    package names no published site, the page by its title and its path on the site:
    ``the "Random streams per rank" page of the vae-ddp documentation (factors/noise/)``, not a
    file of a checkout, which an installed package's user does not have.
    """
    stem = page.removesuffix(".md")
    stem = "" if stem == "index" else stem.removesuffix("/index") + "/"
    base = docs_url()
    if not base:
        return f'the "{page_title(page)}" page of the vae-ddp documentation ({stem or "its home page"})'
    return base + stem


# --- what the watch checks read from a running fit -------------------------------------------------

def world(trainer: Any) -> int:
    """The trainer's world size (1 when it has none)."""
    return int(getattr(trainer, "world_size", 1) or 1)


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor of a batch: a tensor, or any nesting of sequences, mappings (a Hugging Face
    ``BatchEncoding`` too), namedtuples and dataclasses, as Lightning walks batches
    (``lightning_utilities.apply_to_collection``), in their order."""
    from lightning_utilities.core.apply_func import apply_to_collection

    out: list[torch.Tensor] = []
    apply_to_collection(batch, torch.Tensor, out.append)
    return out


def cast_batch(batch: Any, dtype: torch.dtype) -> Any:
    """``batch`` with its floating-point tensors cast to ``dtype`` (the rest as they are)."""
    from lightning_utilities.core.apply_func import apply_to_collection

    return apply_to_collection(batch, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)


def chunk_batch(batch: Any, n: int) -> list[Any]:
    """``batch`` split into ``n`` per-rank chunks along the batch dimension (``Tensor.chunk``).

    Raises:
        TypeError: the batch holds no tensor.
    """
    from lightning_utilities.core.apply_func import apply_to_collection

    if not batch_tensors(batch):
        raise TypeError(f"cannot split a batch of type {type(batch).__name__}")
    return [apply_to_collection(batch, torch.Tensor, lambda t, i=i: t.chunk(n)[i]) for i in range(n)]


def loader_list(loaders: Optional[Any]) -> list:
    """A DataLoader, a list of them, or a dict of them, as a list."""
    if loaders is None:
        return []
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]


def samplers(loaders: Optional[Any]) -> list:
    """The samplers of a DataLoader, a list of them, or a dict of them (CombinedLoader flattened)."""
    out = []
    for dl in loader_list(loaders):
        s = getattr(dl, "sampler", None)
        bs = getattr(dl, "batch_sampler", None)
        if bs is not None and getattr(bs, "sampler", None) is not None:
            s = bs.sampler
        if s is not None:
            out.append(s)
    return out


def rng_states(module: Any) -> list[torch.Tensor]:
    """The global CPU generator's state, and the module's CUDA device's when on a GPU."""
    states = [torch.get_rng_state()]
    if module.device.type == "cuda":
        states.append(torch.cuda.get_rng_state(module.device))
    return states


def gather_objects(value: Any) -> list:
    """``value`` (any picklable object) from every rank, in rank order (``all_gather_object``;
    ``[value]`` without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def gather_ints(value: int) -> list[int]:
    """``value`` from every rank (see ``gather_objects``)."""
    return [int(v) for v in gather_objects(value)]


def gather_digest(payload: bytes) -> list[bytes]:
    """``payload``'s sha256 digest from every rank (see ``gather_objects``)."""
    return gather_objects(hashlib.sha256(payload).digest())
