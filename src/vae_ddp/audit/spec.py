"""What one audit run trains: the user's classes, the world size and the fixes that are on.

A class is given as ``{"class_path": "pkg.mod.Class", "init_args": {...}}`` (the form
jsonargparse and LightningCLI use) plus, for ``path/to/file.py:Class``, the file to import
first (:func:`import_class` registers it under a module name of its own, in every process).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.abc
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

__all__ = ["AuditRun", "DEFAULT_STEPS", "import_class", "resolve_class_arg", "failed_marker", "TRAINER_ARGS",
           "TRAINER_SET", "TRAINER_OVERRIDDEN", "DDP_STRATEGIES", "DECIDING", "DRAWS_LEFT", "HAS_BUFFERS", "LEFT",
           "ONE_DEVICE", "SEEN_FILE", "seen_in", "trained", "same_runs"]

#: Optimizer steps per run where the caller names none: the command (``--steps``), the Python API and the pytest
#: helper alike.
DEFAULT_STEPS = 3

DDP_STRATEGIES = ("ddp", "ddp_find_unused_parameters_true", "ddp_find_unused_parameters_false")
"""``--trainer.strategy`` values: Lightning's registered DDP strategies that launch by
re-running the command (``find_unused_parameters=True`` for modules that leave parameters
out of a loss, such as a GAN's two optimizers)."""

TRAINER_ARGS: dict[str, str] = {
    "strategy": f"one of {', '.join(DDP_STRATEGIES)} (default: ddp; ddp_find_unused_parameters_true for a module "
                "whose losses leave parameters out, such as a GAN's two optimizers)",
    "precision": "64-true, 32-true, bf16-mixed (CPU and GPU) or 16-mixed (GPU); default from --dtype. Under *-mixed "
                 "the parameters are float32 and the least difference counted is one rounding unit of the autocast "
                 "dtype (torch.finfo(torch.bfloat16).eps)",
    "max_epochs": "what self.trainer.max_epochs reads in your module (a schedule's length; default 1000, what a "
                  "Trainer without max_epochs and max_steps gives it); the runs stop after --steps optimizer steps, "
                  "or at the end of this many epochs if sooner",
    "accumulate_grad_batches": "gradients accumulated over k batches before each optimizer step",
    "gradient_clip_val": "gradients clipped at this value (gradient_clip_algorithm: norm or value)",
    "gradient_clip_algorithm": "norm (default) or value",
    "deterministic": "torch's deterministic algorithms: true, false or warn",
    "detect_anomaly": "autograd's anomaly detection",
    "use_distributed_sampler": "false: your own sampler, kept in the DDP runs without the audit's sampler fix (which "
                               "deals one device's global batches itself); its batches judged as Lightning's are",
    "sync_batchnorm": "your BatchNorm fix, kept in the DDP runs (on CPU as plugins=[GlobalSyncBatchNorm()], the same "
                      "global-batch statistics: torch's SyncBatchNorm refuses CPU tensors); a run with the audit's own "
                      "BatchNorm fix uses that one instead, never both",
}
"""``Trainer`` arguments whose meaning in the audit its help states (name -> text); every other
argument of ``Trainer`` goes through as well (``--trainer.NAME VALUE``, LightningCLI's spelling),
except those of ``TRAINER_SET``."""

TRAINER_SET: dict[str, str] = {
    "num_nodes": "--devices, on one node",
    "max_steps": "--steps", "min_steps": "--steps", "max_time": "--steps", "fast_dev_run": "--steps",
    "overfit_batches": "the batches each step trains on",
    "plugins": "the fixes; BatchNorm's LayerSync alone is taken as sync_batchnorm", "callbacks": "its probes and fixes",
    "limit_val_batches": "no validation", "num_sanity_val_steps": "no validation",
}
"""``Trainer`` arguments the audit sets itself in every run (``vae_ddp.audit.run.build``) that change which steps
are compared, each with what sets it: refused as ``--trainer.NAME``."""

TRAINER_OVERRIDDEN: dict[str, str] = {
    "accelerator": "--accelerator", "devices": "--devices and one device", "logger": "no logger",
    "enable_checkpointing": "no checkpoints", "enable_progress_bar": "no progress bar",
    "enable_model_summary": "no summary",
}
"""``Trainer`` arguments that do not change what the audit compares: accepted (a project's LightningCLI config as
it is), replaced in every run by what the audit uses (name -> what that is), and named in the report's notes where
the user's value differs."""


def _module_name(path: Path) -> str:
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
    return f"_vae_ddp_user_{path.stem}_{digest}"


def resolve_class_arg(value: str) -> tuple[str, Optional[str]]:
    """``path/to/file.py:Class`` -> (``module.Class`` importable in this process, file); a
    dotted path is returned as it is.

    Raises:
        ValueError: the file does not exist.
    """
    if ".py:" not in value:
        return value, None
    file, _, name = value.rpartition(":")
    path = Path(file)
    if not path.is_file():
        raise ValueError(f"{file} does not exist: give path/to/file.py:Class or package.module.Class")
    mod = _import_file(path)
    return f"{mod.__name__}.{name}", str(path.resolve())


def _import_file(path: Path):
    name = _module_name(path)
    if name in sys.modules:
        return sys.modules[name]
    # Processes started from this one (DataLoader workers, a forkserver) find the module by
    # its name through _UserFiles, which reads this variable.
    files = json.loads(os.environ.get(_ENV_FILES) or "{}")
    files[name] = str(path.resolve())
    os.environ[_ENV_FILES] = json.dumps(files)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


_ENV_FILES = "VAE_DDP_USER_FILES"


class _UserFiles(importlib.abc.MetaPathFinder):
    """Finds the modules that ``path/to/file.py:Class`` arguments were imported as, by name, in
    any process that inherits ``$VAE_DDP_USER_FILES``: a dataset class of the user's file is
    pickled by that name for a DataLoader worker, which must import it again."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("_vae_ddp_user_"):
            return None
        file = json.loads(os.environ.get(_ENV_FILES) or "{}").get(fullname)
        return importlib.util.spec_from_file_location(fullname, file) if file else None


if not any(isinstance(f, _UserFiles) for f in sys.meta_path):
    sys.meta_path.append(_UserFiles())


def import_class(class_path: str, file: Optional[str] = None) -> type:
    """The class named ``class_path``, importing ``file`` first when the class lives in a file."""
    if file:
        _import_file(Path(file))
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def failed_marker(steps_file: Path) -> Path:
    """The file whose presence tells the teacher-forced runs waiting for ``steps_file`` that
    the reference run failed; it holds the label of the run that failed (``train_runs``)."""
    return steps_file.with_suffix(".failed")


#: The folder (in the launch's folder) of the one-device runs, beside ``ddp``: their files.
ONE_DEVICE = "one-device"

#: The DDP runs whose ``DDPAudit`` findings decide, inside the launch, which runs of ``AuditRun.if_seen``
#: train: Lightning's defaults, then every fix on (the first two DDP runs of every audit).
DECIDING = ("ddp", "ddp+fixed")

#: The token of ``AuditRun.if_seen`` for the check of buffers beside draws no automatic fix serves: a
#: deciding run saw such draws (a ``noise`` finding only the user's code fixes) in a module with buffers.
DRAWS_LEFT = "draws-left"

#: The token of ``AuditRun.if_seen`` for a module with buffers (parameters aside), as the deciding runs saw it.
HAS_BUFFERS = "has-buffers"

#: The token of ``AuditRun.if_seen`` for what only the user's code fixes: a deciding run's finding no automatic
#: fix removes, or a step with every fix (``localise.RANKS_GRADS``) that its judgement cannot pass as one
#: device's (``judge.step_left``). DDP's runs only: the one-device process does not wait for it.
LEFT = "left-for-code"

#: The file (in the launch's folder, beside its groups' folders) where rank 0 of the DDP runs writes what
#: the deciding runs saw (``{"seen": [if_seen tokens], "idle": [factor keys]}``), for the one-device process
#: beside them.
SEEN_FILE = "seen.json"

#: The file in a group's folder where its rank 0 says, after each run, the runs done and how many are to come
#: as known so far (``{"done": [labels], "to_come": int}``): the audit's progress lines
#: ([`watch`][vae_ddp.audit.measure.watch]).
PROGRESS_FILE = "progress.json"


def seen_in(label: str, findings: list[dict], has_buffers: bool) -> set[str]:
    """The ``if_seen`` tokens a deciding run (``label``, one of ``DECIDING``) gives from its ``DDPAudit``
    findings (``[{"factor", "manual", ...}]``, rank 0's): the ``ddp`` run's factor keys an automatic fix
    removes (what the audit's judgement calls exposed: ``judge._exposures``), ``LEFT`` for a finding only the
    user's code fixes, ``HAS_BUFFERS`` for a module with buffers, and ``DRAWS_LEFT`` where a
    ``noise`` finding only the user's code fixes stands in a module with buffers (``has_buffers``):
    where the judgement may check whether the buffers follow from those draws."""
    from vae_ddp.fixes import noise

    seen = {f["factor"] for f in findings if not f.get("manual")} if label == DECIDING[0] else set()
    if any(f.get("manual") for f in findings):
        seen.add(LEFT)
    if has_buffers:
        seen.add(HAS_BUFFERS)
    if has_buffers and any(f["factor"] == noise.FACTOR.key and f.get("manual") and not f.get("unkeyed")
                           for f in findings):
        seen.add(DRAWS_LEFT)
    return seen


def trained(run: "AuditRun", seen: set[str]) -> bool:
    """Whether ``run`` trains once the deciding runs saw ``seen`` (its ``if_seen`` empty, or one of them seen)."""
    return not run.if_seen or bool(seen & set(run.if_seen))


def same_runs(runs: list["AuditRun"], seen: set[str], idle: set[str]) -> dict[str, str]:
    """``{label: label of the run that computes the same}`` among the ``runs`` that train (``trained``):
    a run that differs from another only by its label, ``if_seen`` and fixes in ``idle`` (factor keys whose
    fix changed nothing in the run with every fix: ``Audit.idle``) is that run; of such runs the first one
    trained always (no ``if_seen``), else the first, trains for all."""
    def key(run: "AuditRun") -> str:
        d = dataclasses.asdict(run)
        del d["label"], d["if_seen"]
        d["fixes"] = [f for f in run.fixes if f not in idle]
        return json.dumps(d, sort_keys=True)

    first: dict[str, str] = {}
    kept = [run for run in runs if trained(run, seen)]
    for run in sorted(kept, key=lambda r: bool(r.if_seen)):  # stable: the plan's order within each kind
        first.setdefault(key(run), run.label)
    return {run.label: first[key(run)] for run in kept if first[key(run)] != run.label}


@dataclass
class AuditRun:
    """One training run of the audit (JSON-serialisable; the child process re-reads it).

    Attributes:
        model, data: ``{"class_path", "init_args"}`` of the LightningModule and DataModule.
        model_file, data_file: the ``.py`` file to import first, or None.
        devices: the world size of this run (1: one device).
        global_batch_size: samples per optimizer step over all ranks (B); each rank's
            DataModule gets ``batch_size = B // devices``.
        steps: optimizer steps. dtype: ``float64`` or ``float32``. accelerator: ``cpu``/``gpu``.
        seed: ``seed_everything(seed)`` before the model is built (same initial weights).
        fixes: keys of the factors whose audit fix is on (those of
            [`audit_fixable`][vae_ddp.fixes.registry.audit_fixable]).
        permute: 0, or the draw (1, 2, ...) of a permutation of the samples inside each batch
            (the noise rows permuted with them): the one-device reordering floor.
        steps_file: a ``.pt`` file of per-step weights: the run records its weights θ_k, gradients
            and buffers there (``teacher_forced`` False; one device) or starts every batch from
            the θ_k recorded there (``teacher_forced`` True), see
            [`StepProbe`][vae_ddp.probes.StepProbe].
        teacher_forced: start every batch from the weights of ``steps_file``.
        lag: with ``teacher_forced``: start batch k from the weights of batch k - ``lag``
            (another batch at the same weights: the batch-to-batch gradient noise; 0: the same
            batch).
        sketch: 0, or keep the recorded vectors longer than this as CountSketches of that length
            ([`StepProbe`][vae_ddp.probes.StepProbe]'s ``sketch``).
        effect_batches: the global batches each run of [`vae_ddp.audit.effects`][vae_ddp.audit.effects]
            takes (0: none of them run).
        repeat: with ``teacher_forced``: batch b starts from the weights of batch ``b // repeat`` (0: of
            batch b, or b - ``lag``): ``repeat`` global batches at each of the reference's weights, the
            samples of [`vae_ddp.audit.effects`][vae_ddp.audit.effects].
        eval_mode: run each training step with the module in eval mode (``module.eval()``: no
            dropout, BatchNorm with its running statistics), as the one-process reduction check
            does: a forced pair of these (one device, DDP) tells whether the loss reduces over
            the global batch under the real process group.
        trainer: Trainer arguments of the user's training that every run takes alike
            (any but ``TRAINER_SET``: ``strategy`` for the DDP runs, ``accumulate_grad_batches``,
            ``gradient_clip_val``, ...).
        label: the run's name in the report.
        dealt_to: the DDP world size N the audit compares with (every run alike, one device's too):
            the sampler fix leaves out a global batch N does not divide (an incomplete last batch),
            in every run, so that step k is the same batch on one device and under DDP.
        attention_dropout: False: ``scaled_dot_product_attention``'s dropout off during the run
            ([`NoAttentionDropout`][vae_ddp.audit.draws.NoAttentionDropout]), for the compared runs of
            a module whose attention dropout no run can key to the sample.
        keyed_draws: True: torch's random functions called in the training step keyed to the samples
            ([`KeyedTorchDraws`][vae_ddp.audit.draws.KeyedTorchDraws]), for the compared runs of a
            module that draws with them.
        keyed_items: True: the training dataset's draws in ``__getitem__`` keyed to the sample's index
            ([`KeyedItems`][vae_ddp.audit.loader_draws.KeyedItems]), for the compared runs of a dataset
            that draws anew on every read.
        probe_items: True: the ranks compare what their loaders draw for the same samples
            ([`measure`][vae_ddp.audit.loader_draws.measure]), in the run with Lightning's defaults.
        sync_grads: True: every ``self.all_gather`` of a tensor that requires a gradient gathers with
            ``sync_grads=True``, whatever the call says ([`watch_gathers`][vae_ddp.audit.localise.watch_gathers]
            with ``force``): the audit's check of its ``sync_grads`` advice
            (``localise.SYNC_GRADS``, trained only after the run of ``localise.RANKS_GRADS`` saw such
            a gather).
        if_seen: empty: the run is always trained; else trained only when the launch's deciding DDP runs
            (``DECIDING``) saw one of these (``seen_in``): a factor's key, the ``ddp`` run's ``DDPAudit``
            finding an automatic fix removes, or ``DRAWS_LEFT``. Skipped otherwise: the factor's runs
            of an audit whose model is not exposed to it.
        param_count: the module's parameters (elements), which the pre-flight counted (0: not counted):
            what [`saved_bytes`][vae_ddp.audit.spec.AuditRun.saved_bytes] estimates from.
        lightning: the Lightning package the user's classes are built on, ``pytorch_lightning`` or
            ``lightning`` (``lightning.pytorch``): the runs' processes use that package's Trainer and classes
            ([`vae_ddp.lightning_package`][vae_ddp.lightning_package]).
        instances: ``"model"``/``"data"`` -> the instance the caller gave, pickled
            ([`saved`][vae_ddp.audit.user_objects.saved]): every run starts from a copy of it
            ([`build`][vae_ddp.audit.user_objects.build]) instead of building the class.
    """

    model: dict
    data: dict
    model_file: Optional[str] = None
    data_file: Optional[str] = None
    devices: int = 1
    global_batch_size: int = 32
    steps: int = 4
    dtype: str = "float64"
    accelerator: str = "cpu"
    seed: int = 0
    fixes: list[str] = field(default_factory=list)
    permute: int = 0
    steps_file: Optional[str] = None
    teacher_forced: bool = False
    lag: int = 0
    repeat: int = 0
    effect_batches: int = 32
    sketch: int = 0
    eval_mode: bool = False
    trainer: dict = field(default_factory=dict)
    label: str = ""
    dealt_to: int = 1
    attention_dropout: bool = True
    keyed_draws: bool = False
    keyed_items: bool = False
    probe_items: bool = False
    sync_grads: bool = False
    if_seen: list[str] = field(default_factory=list)
    param_count: int = 0
    lightning: str = "pytorch_lightning"
    instances: dict = field(default_factory=dict)

    #: Bytes of the logs, ``run.json`` files and report beside an audit's tensors, at most
    #: ([`space_needed`][vae_ddp.harness.resources.space_needed]): an audit of ``examples.audit_models.Plain``
    #: (``--steps 2``) wrote 35 kB of them; what the user's own code prints to the logs comes on top.
    log_bytes = 128 * 2 ** 10
    #: Bytes a run's two tensor files take beyond their tensors (pickle and zip headers, the file system's
    #: blocks): 12-16 kB per file for ``Plain``'s 2-step runs.
    FILE_BYTES = 16 * 2 ** 10

    @property
    def world_size(self) -> int:
        return self.devices

    def saved_bytes(self) -> int:
        """Bytes this run writes at most (rank 0 alone writes): its final state (one vector of the
        ``param_count`` parameters) and per step up to three vectors (gradient, update, buffers), each a
        CountSketch of ``sketch`` elements where the run sketches; the run that records one device's weights
        for the others (``steps_file`` without ``teacher_forced``) three vectors more per step. A vector is
        8 bytes an element in float64, else 4. Measured on models of 465 and 200,001 parameters: the
        estimate summed over an audit's planned runs (also those trained only where their factor is exposed)
        lies between 1x and 3x the most its folder held (``tests/audit/test_disk.py``)."""
        itemsize = 8 if self.dtype == "float64" else 4
        vector = min(self.param_count, self.sketch) if self.sketch else self.param_count
        per_step = 3 * vector + (3 * self.param_count if self.steps_file and not self.teacher_forced else 0)
        return self.FILE_BYTES + itemsize * (self.param_count + self.steps * per_step)

    def replace(self, **kw: Any) -> "AuditRun":
        return dataclasses.replace(self, **kw)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "AuditRun":
        return cls(**json.loads(text))
