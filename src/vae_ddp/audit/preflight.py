"""The audit's checks of its input, before any training: each bad input one
[`UserError`][vae_ddp.errors.UserError] line (what is wrong, what to do).

- the classes: [`class_arg`][vae_ddp.audit.preflight.class_arg] turns ``--model``/``--data``
  (``package.module.Class`` or ``path/to/file.py:Class``) into an importable class path, once
  it is known to import and to be a ``LightningModule``/``LightningDataModule``; jsonargparse
  calls it on the flag's value (``vae_ddp.audit.cli.AuditParser``);
- the Trainer's arguments: [`trainer_args`][vae_ddp.audit.preflight.trainer_args] (those the audit
  sets itself refused, the others typed from ``Trainer``'s signature and checked by Lightning);
- the run: [`check`][vae_ddp.audit.preflight.check] (world size, batch size, the data module
  yields batches, the module's ``training_step`` runs on one batch) and the one-process checks;
- the output folder ([`writable`][vae_ddp.audit.preflight.writable]).

This module imports torch and Lightning only inside the functions that need them: the audit's
parser (and ``vae-ddp audit --help``) builds on its class stand-ins without them.
"""

from __future__ import annotations

import abc
import contextlib
import inspect
import itertools
import warnings
from pathlib import Path
from typing import Any, Optional

from vae_ddp.audit import user_objects, users_trainer
from vae_ddp.audit.attached import one_device_trainer
from vae_ddp.errors import UserError
from vae_ddp.lightning_package import is_a, one_package

__all__ = ["LightningModule", "LightningDataModule", "class_arg", "as_given", "trainer_args", "check",
           "writable", "STATIC_BATCHES", "PRECISIONS"]

#: global batches of the user's training loader that the one-process checks look at
STATIC_BATCHES = 4

#: ``--trainer.precision`` values the audit runs (Lightning's names): the parameters' dtype follows
#: (float64 for 64-true, else float32), overriding --dtype.
PRECISIONS = ("64-true", "32-true", "bf16-mixed", "16-mixed")

#: Lightning's base class of each class flag (checked by name: no import of Lightning to build the parser), as
#: ``pytorch_lightning`` names it; ``lightning.pytorch``'s is accepted alike (``is_a``).
BASES = {"model": "pytorch_lightning.core.module.LightningModule",
         "data": "pytorch_lightning.core.datamodule.LightningDataModule"}


class _ByName(abc.ABC):
    """A stand-in base class for jsonargparse's subclass arguments: a class is its subclass when
    a class of its MRO is ``BASE`` (its module and name), so that the parser is built, and
    ``--help`` answers, without importing torch and Lightning."""

    BASE = ""

    @abc.abstractmethod
    def _stand_in(self) -> None:
        """Abstract: jsonargparse lists no stand-in among the classes a flag takes."""

    @classmethod
    def __subclasshook__(cls, other: type) -> Any:
        return is_a(other, cls.BASE) or NotImplemented


class LightningModule(_ByName):
    """Your LightningModule."""

    BASE = BASES["model"]


class LightningDataModule(_ByName):
    """Your LightningDataModule."""

    BASE = BASES["data"]


#: each importable class path made of a file (``_vae_ddp_user_….Class``) -> the user's ``path/to/file.py:Class``
_GIVEN: dict[str, str] = {}
#: each importable class path made of a file -> that file (the runs import it first)
_FILES: dict[str, str] = {}


def as_given(text: str, absolute: bool = False) -> str:
    """``text`` with each class made of a file and its module named as the user did
    (``path/to/file.py:Class``, ``path/to/file.py``); ``absolute``: with the file's absolute path
    (a config file's relative paths are read from its own folder)."""
    given = {path: f"{_FILES[path]}:{path.rpartition('.')[2]}" if absolute else value for path, value in _GIVEN.items()}
    for path, value in given.items():  # the classes first: a module's name is the start of its classes'
        text = text.replace(path, value)
    for path, value in given.items():
        text = text.replace(path.rpartition(".")[0], value.rpartition(":")[0])
    return text


def class_arg(key: str, value: str) -> str:
    """The class path of ``--KEY VALUE`` (``key``: ``model``, ``data``, ``model.help`` or
    ``data.help``), importable in this process: ``path/to/file.py:Class`` becomes the module
    made of the file (:func:`vae_ddp.audit.spec.resolve_class_arg`); a YAML/JSON config or a
    dict is returned as it is.

    Raises:
        UserError: ``value`` is no class path ([`class_path_problem`][vae_ddp.audit.argv.class_path_problem]:
            ``shapes:Net``), the file does not exist, the module does not import or defines no such
            class, or the class is not a LightningModule (``model``) / LightningDataModule (``data``).
    """
    from importlib import import_module

    from vae_ddp.audit.argv import class_path_problem
    from vae_ddp.audit.spec import resolve_class_arg

    flag = f"--{key}"
    if not isinstance(value, str) or value.startswith(("{", "-")) or value.endswith((".yaml", ".yml", ".json")):
        return value
    if value not in _GIVEN and (problem := class_path_problem(flag, value)):  # _GIVEN's: made of a file
        raise UserError(problem)
    try:
        path, file = resolve_class_arg(value)
    except Exception as err:  # noqa: BLE001 - the user's file fails to import
        raise UserError(f"{flag}: {value} does not import: {type(err).__name__}: {_first(err)}") from None
    if file:
        _GIVEN[path], _FILES[path] = value, file
    module, _, name = path.rpartition(".")
    try:
        mod = import_module(module) if module else None
    except Exception as err:  # noqa: BLE001 - the user's module fails to import
        raise UserError(f"{flag} {value} does not import ({type(err).__name__}: {err}): give "
                        "package.module.Class or path/to/file.py:Class") from None
    if mod is not None and not hasattr(mod, name):
        where = value.rpartition(":")[0] if path != value else module
        raise UserError(f"{flag} {value} does not import ({where} defines no {name}): give "
                        "package.module.Class or path/to/file.py:Class")
    cls, base = getattr(mod, name, None), BASES[key.split(".")[0]]
    if not is_a(cls, base):
        raise UserError(f"{flag} {value} is not a {base.rpartition('.')[2]} subclass (of pytorch_lightning or "
                        "lightning.pytorch): give package.module.Class or path/to/file.py:Class")
    return path


def trainer_args(given: Optional[dict]) -> dict:
    """The ``--trainer.NAME VALUE`` arguments (``given``: jsonargparse's dict of them) that differ from Lightning's
    defaults, once checked: typed as ``Trainer``'s signature types them (jsonargparse) and accepted by Lightning (a
    ``Trainer`` built with them, its chatter silenced); BatchNorm's ``LayerSync`` plugins as ``sync_batchnorm``.

    Raises:
        UserError: an argument the audit sets itself (``TRAINER_SET``) or that ``Trainer`` does not
            take (the line lists those it accepts), a strategy not of ``DDP_STRATEGIES``, a
            precision not of ``PRECISIONS``, a value of the wrong type or one Lightning refuses.
    """
    import torch
    from jsonargparse import ArgumentParser
    from pytorch_lightning import Trainer

    from vae_ddp.audit.spec import DDP_STRATEGIES, TRAINER_OVERRIDDEN, TRAINER_SET
    from vae_ddp.errors import one_line

    given, params = users_trainer.layer_sync_plugins(dict(given or {})), inspect.signature(Trainer).parameters
    accepted = [k for k in params if k not in TRAINER_SET]
    for key in given:
        if "-" in key:  # --trainer.max-steps: LightningCLI's names are the Python ones
            raise UserError(f"--trainer.{key}: flags are the Python names, with underscores: "
                            f"--trainer.{key.replace('-', '_')}")
        if key not in accepted:
            why = f"the audit sets it ({TRAINER_SET[key]})" if key in TRAINER_SET else "Trainer takes no such argument"
            used = [k for k in accepted if k not in TRAINER_OVERRIDDEN]  # those it replaces change nothing
            raise UserError(f"--trainer.{key}: {why}; the audit accepts --trainer.{', --trainer.'.join(used)}")
    if str(given.get("strategy") or "ddp") not in DDP_STRATEGIES:
        raise UserError(f"--trainer.strategy {given['strategy']!r} is not a DDP strategy the audit launches: give one "
                        f"of {', '.join(DDP_STRATEGIES)}")
    if given.get("precision") is not None and str(given["precision"]) not in PRECISIONS:
        raise UserError(f"--trainer.precision {str(given['precision'])!r} is not one the audit compares: give one of "
                        f"{', '.join(PRECISIONS)}")
    typed = ArgumentParser(exit_on_error=False)
    typed.add_class_arguments(Trainer, "trainer", skip=set(TRAINER_SET))
    try:
        typed.parse_object({"trainer": given})
    except Exception as err:  # noqa: BLE001 - jsonargparse's ArgumentError/TypeError: one line of it
        raise UserError(one_line(str(err))) from None
    args = {k: v for k, v in given.items() if v is not None and v != params[k].default}
    if args.get("accumulate_grad_batches", 1) < 1:  # Lightning takes 0 and fails at the first step
        raise UserError(f"--trainer.accumulate_grad_batches must be at least 1, got {args['accumulate_grad_batches']}")
    rest = {k: v for k, v in args.items() if k not in {"strategy", "precision", *TRAINER_OVERRIDDEN}}
    deterministic = torch.are_deterministic_algorithms_enabled()  # Trainer(deterministic=True) sets it
    try:  # Lightning's own checks of the values, here rather than in every run (its chatter silenced)
        one_device_trainer(**rest)
    except Exception as err:  # noqa: BLE001 - Lightning's MisconfigurationException/ValueError: its first line
        raise UserError(f"--trainer.{'/'.join(rest)}: {_first(err) or type(err).__name__}") from None
    finally:
        torch.use_deterministic_algorithms(deterministic)
    return args


def audit_run(cfg: dict) -> tuple[Any, type, type]:
    """The [`AuditRun`][vae_ddp.audit.spec.AuditRun] of the parsed command line ``cfg`` (a dict),
    and the module's and datamodule's classes. The global batch size is ``--data.init_args.batch_size``,
    else the datamodule's default; the dtype follows ``--trainer.precision`` when given.

    Raises:
        UserError: bad Trainer arguments ([`trainer_args`][vae_ddp.audit.preflight.trainer_args]).
    """
    from vae_ddp.audit.spec import AuditRun, import_class

    classes = {key: {"class_path": cfg[key]["class_path"], "init_args": dict(cfg[key].get("init_args") or {})}
               for key in ("model", "data")}
    model_cls, data_cls = (import_class(classes[k]["class_path"]) for k in ("model", "data"))
    gbs = classes["data"]["init_args"].get("batch_size")
    if gbs is None:
        default = inspect.signature(data_cls).parameters.get("batch_size")
        gbs = None if default is None or default.default is inspect.Parameter.empty else default.default
    trainer = trainer_args(cfg.get("trainer"))
    package, seed = one_package(model_cls, data_cls), cfg.get("seed_everything")  # LightningCLI's, an int: the seed
    seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else cfg["seed"]
    precision = trainer.get("precision")
    dtype = cfg["dtype"] if precision is None else "float64" if str(precision) == "64-true" else "float32"
    run = AuditRun(model=classes["model"], data=classes["data"], model_file=_FILES.get(classes["model"]["class_path"]),
                   data_file=_FILES.get(classes["data"]["class_path"]), devices=cfg["devices"],
                   global_batch_size=int(gbs or 0), steps=cfg["steps"], dtype=dtype, accelerator=cfg["accelerator"],
                   seed=seed, trainer=trainer, effect_batches=cfg["effect_batches"], lightning=package)
    return run, model_cls, data_cls


def writable(out: str) -> Path:
    """``--out`` as a ``Path`` once it is a folder that can be written
    ([`check_writable`][vae_ddp.utils.check_writable]).

    Raises:
        UserError: it is a file, or cannot be created or written.
    """
    from vae_ddp.utils import check_writable

    try:
        return check_writable(out)
    except OSError as err:
        raise UserError(str(err).replace("out_dir", "--out", 1)) from None


#: What Lightning says when a module calls a Trainer-attached method (``self.all_gather``,
#: ``self.trainer``, ...) without one (``LightningModule.trainer``, Lightning 2.x).
_NO_TRAINER = "is not attached to a `Trainer`"


def check(run, data_cls: type, model_cls: type, cost: Optional[list] = None,
          sizes: Optional[dict] = None) -> tuple[list[dict], list[str]]:
    """Bad input before any training: one [`UserError`][vae_ddp.errors.UserError] line each, a
    world size whose processes would not fit in memory included
    ([`audit_cost`][vae_ddp.harness.resources.audit_cost], checked before the module is built and
    again with its parameters). ``cost``: a list the line of what the runs will cost is appended to;
    ``sizes``: a dict given ``param_count``, the module's parameters (elements), once it is built.

    Returns the findings of the one-process checks ([`static_findings`][vae_ddp.audit.static.static_findings])
    and notes: a ``training_step`` that needs a Trainer (``self.all_gather``, ...) skips the
    checks that call it (the DDP runs answer for it) instead of being refused."""

    import torch
    from vae_ddp.harness.resources import audit_cost

    if run.devices < 2:
        raise UserError("--devices must be at least 2 (the DDP world size to compare with one device), "
                        f"got {run.devices}")
    if run.accelerator == "cpu":
        audit_cost(run.devices)  # the processes alone: refused before anything is built
    if run.steps < 1:
        raise UserError(f"--steps must be at least 1, got {run.steps}")
    if run.effect_batches != 0 and run.effect_batches < 4:
        raise UserError(f"--effect_batches must be 0 (skip) or at least 4, got {run.effect_batches}")
    if all(k.__dict__.get("training_step") is None for k in model_cls.__mro__ if k.__name__ != "LightningModule"):
        raise UserError(f"{model_cls.__name__} has no training_step: the audit trains it, so define one")
    if "batch_size" not in inspect.signature(data_cls).parameters and "data" not in run.instances:
        raise UserError(f"{data_cls.__name__} takes no batch_size argument: the audit sets the per-device batch "
                        "through it (batch_size = global batch / devices)")
    if run.global_batch_size < 1:
        raise UserError(f"{data_cls.__name__} has no batch_size: give the global batch size with "
                        "--data.init_args.batch_size")
    if run.global_batch_size % run.devices:
        raise UserError(f"global batch size {run.global_batch_size} (--data.init_args.batch_size) is not divisible "
                        f"by {run.devices} devices: pick a multiple of {run.devices}")
    if run.accelerator == "gpu" and torch.cuda.device_count() < run.devices:
        raise UserError(f"--accelerator gpu with {run.devices} devices needs that many CUDA devices, this machine "
                        f"has {torch.cuda.device_count()}: use --accelerator cpu")
    try:
        dm = user_objects.build(run, "data", run.global_batch_size, data_cls)  # (a copy of an instance given)
    except Exception as err:  # noqa: BLE001 - the user's class: its first line
        raise UserError(f"{data_cls.__name__}(...) fails ({type(err).__name__}: {_first(err)}): check --data's "
                        "init args") from None
    dm.trainer = one_device_trainer(run.lightning)  # as Lightning attaches one before any hook (self.trainer.*)
    try:
        dm.prepare_data()
        dm.setup("fit")
        with torch.random.fork_rng():  # the same batches on every audit of this seed
            torch.manual_seed(run.seed)
            batches = list(itertools.islice(dm.train_dataloader(), STATIC_BATCHES))
        if not batches:
            raise StopIteration
        batch = batches[0]
    except StopIteration:
        raise UserError(f"{data_cls.__name__}.train_dataloader() yields no batch: give it data") from None
    except Exception as err:  # noqa: BLE001 - the user's datamodule: its first line
        raise UserError(f"{data_cls.__name__} yields no batch ({type(err).__name__}: {_first(err)}): check its setup() "
                        "and train_dataloader()") from None
    size = _dataset_size(dm)
    if size is not None and size < run.global_batch_size:
        raise UserError(f"{data_cls.__name__}'s training set holds {size} samples, fewer than one global batch of "
                        f"{run.global_batch_size}: give more data or a smaller --data.init_args.batch_size")
    with torch.random.fork_rng():  # the same weights and draws on every audit of this seed, as the runs'
        torch.manual_seed(run.seed)
        return _check_model(run, model_cls, dm, batches, batch, cost, sizes)


def _check_model(run, model_cls: type, dm, batches: list, batch,
                 cost: Optional[list] = None, sizes: Optional[dict] = None) -> tuple[list[dict], list[str]]:
    """Build the module, say what its runs cost (refused when they do not fit), try its
    training_step on one batch without a Trainer, run the one-process checks."""
    import torch

    from vae_ddp.fixes.factor import cast_batch as _cast
    from vae_ddp.harness.resources import audit_cost
    try:
        model = user_objects.build(run, "model", cls=model_cls)
    except Exception as err:  # noqa: BLE001 - the user's class: its first line
        raise UserError(f"{model_cls.__name__}(...) fails ({type(err).__name__}: {_first(err)}): check --model's "
                        "init args") from None
    count = sum(p.numel() for p in model.parameters())
    if sizes is not None:
        sizes["param_count"] = count
    if run.accelerator == "cpu":
        size = 8 if run.dtype == "float64" else 4
        line = audit_cost(run.devices, count * size)
        if cost is not None:
            cost.append(line)
    if model.automatic_optimization:  # manual optimization needs the trainer's optimizers: no dry run
        dtype = torch.float64 if run.dtype == "float64" else torch.float32
        try:
            layers = _dry_run(model.to(dtype=dtype), _cast(batch, dtype))
        except RuntimeError as err:
            if _NO_TRAINER not in str(err):
                raise UserError(_dry_run_error(model_cls, run, err)) from None
            return _with_a_trainer(run, model_cls, model, dm, batches, batch, dtype)
        except Exception as err:  # noqa: BLE001 - the user's code: report its first line
            raise UserError(_dry_run_error(model_cls, run, err)) from None
        _unused_on_a_rank(model_cls, model, [_cast(b, dtype) for b in batches], run)
        findings, notes = _static(model, dm, batches, run)
        return findings + _attention(layers), notes
    return _static(model, dm, batches, run)


def _unused_on_a_rank(model_cls: type, model, batches: list, run) -> None:
    """Refuse (one line naming the parameters and Lightning's flag) a module whose ``training_step``
    leaves parameters without a gradient on some rank's share of a global batch (an expert with no
    samples routed to it, a branch taken by some samples only): DDP without ``find_unused_parameters``
    waits for those gradients on the other ranks and the run hangs or fails. One process: each of
    ``batches`` split into the ranks' contiguous chunks, one backward each. Skipped under
    ``--trainer.strategy ddp_find_unused_parameters_true``, and where a chunk cannot be stepped on its
    own (the DDP runs judge it then)."""
    import torch

    from vae_ddp.fixes.factor import chunk_batch
    from vae_ddp.fixes.reduction import _State

    if (run.trainer or {}).get("strategy") == "ddp_find_unused_parameters_true":
        return
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    unused: dict[str, None] = {}
    state = _State(model)  # a step that writes its own state (a queue, a moving average) is put back after
    try:
        with torch.random.fork_rng(), _no_trainer_warnings():
            for batch in batches:
                for chunk in chunk_batch(batch, run.devices):
                    model.zero_grad(set_to_none=True)
                    out = model.training_step(chunk, 0)
                    loss = out["loss"] if isinstance(out, dict) else out
                    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                        return
                    loss.backward()
                    unused.update((n, None) for n, p in named if p.grad is None)
    except Exception:  # noqa: BLE001 - a chunk the step cannot take alone: the DDP runs judge it
        return
    finally:
        state.restore()
        model.zero_grad(set_to_none=True)
    if unused:
        names = list(unused)
        raise UserError(f"{model_cls.__name__}.training_step leaves {len(names)} parameter(s) without a gradient on "
                        f"some rank's share of a global batch of {run.global_batch_size} on {run.devices} ranks "
                        f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): DDP without "
                        "find_unused_parameters waits for every parameter's gradient at every step, so the runs would "
                        "hang or fail; rerun with --trainer.strategy ddp_find_unused_parameters_true")


def _dry_run(model, batch) -> tuple[list[str], list[str]]:
    """One ``training_step`` on one batch, the caller's generator untouched; returns the draws no fix
    keys to a sample, ``(attention layers, torch draws)`` ([`unkeyed_draws`][vae_ddp.audit.draws.unkeyed_draws])."""
    import torch

    from vae_ddp.audit.draws import unkeyed_draws

    with torch.random.fork_rng(), _no_trainer_warnings():
        return unkeyed_draws(model, lambda: model.training_step(batch, 0))


def _attention(layers: tuple[list[str], list[str]]) -> list[dict]:
    """The audit's item for the draws no fix keys to a sample (none without such draws):
    ``{"attention_layers": [...], "torch_draws": [...]}``."""
    attention, torch_draws = layers
    return [{"attention_layers": attention, "torch_draws": torch_draws}] if attention or torch_draws else []


def _with_a_trainer(run, model_cls: type, model, dm, batches: list, batch, dtype) -> tuple[list[dict], list[str]]:
    """The one-process checks of a ``training_step`` that reads ``self.trainer`` (its world size, an
    ``all_gather``): with a one-device ``Trainer`` attached (``self.log`` a no-op: no loop collects it),
    so that a loss that couples the samples is still found (a flag the DDP runs then clear for a loss
    that gathers over the global batch). A step that needs more of a fit (its optimizers, a datamodule)
    skips the checks with a note: the DDP runs compare it."""
    from vae_ddp.fixes.factor import cast_batch as _cast

    model.trainer = one_device_trainer(run.lightning)
    model.log = model.log_dict = lambda *args, **kwargs: None
    gathers = _count_gathers(model)
    try:
        layers = _dry_run(model, _cast(batch, dtype))
        findings, notes = _static(model, dm, batches, run)
        if gathers():  # all_gather on one process returns the rank's own batch: a loss over the gathered
            # batch looks coupled here whatever it does under DDP, and only the DDP runs can tell
            coupled = [f for f in findings if f.get("kind") == "coupled"]
            findings = [f for f in findings if f not in coupled]
            notes += [f"{model_cls.__name__}.training_step gathers across ranks (all_gather): the one-process check "
                      "of the loss reduction cannot tell a loss over the gathered batch from one that couples each "
                      "rank's own samples; the DDP runs compare it"] if coupled else []
        return findings + _attention(layers), notes
    except Exception:  # noqa: BLE001 - the user's step needs a fitting Trainer: the DDP runs judge it
        findings, notes = _static(model, dm, [], run)  # the dataset checks only
        return findings, [f"{model_cls.__name__}.training_step needs a fitting Trainer (e.g. its optimizers): the "
                          "one-process check of the loss reduction was skipped; the DDP runs compare it", *notes]
    finally:
        del model.log, model.log_dict
        model.__dict__.pop("all_gather", None)
        model.trainer = None


def _count_gathers(model) -> Any:
    """Wraps ``model.all_gather`` (for the dry run) to count its calls; returns a function that reads the count."""
    calls = []
    original = model.all_gather

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    model.all_gather = counted
    return lambda: len(calls)


def _static(model, dm, batches: list, run) -> tuple[list[dict], list[str]]:
    """[`static_findings`][vae_ddp.audit.static.static_findings], or, when the user's batch or
    step does not lend itself to them (a batch type it cannot split, an iterable dataset, ...),
    none and a note: the DDP runs still judge the model."""
    from vae_ddp.audit.static import static_findings

    try:
        with _no_trainer_warnings():
            found, notes = static_findings(model, dm, batches, run.devices)
        return [f.to_dict() for f in found], notes
    except Exception as err:  # noqa: BLE001 - the user's code or data: the checks are skipped, not the audit
        return [], [f"the one-process checks (loss reduction, random augmentation) could not run "
                    f"({type(err).__name__}: {_first(err)}); the DDP runs judge the model"]


def _first(err: Exception) -> str:
    return str(err).splitlines()[0] if str(err) else ""


def _dataset_size(dm) -> Optional[int]:
    try:
        return len(dm.train_dataloader().dataset)
    except Exception:  # noqa: BLE001 - an iterable dataset has no length: the runs will tell
        return None


def _dry_run_error(model_cls: type, run, err: Exception) -> str:
    where = "on CPU" if run.accelerator == "cpu" else "on the CPU dry run"
    return (f"{model_cls.__name__}.training_step fails {where} on one batch ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}): fix the model so that it runs on CPU, or use "
            "--accelerator gpu")


@contextlib.contextmanager
def _no_trainer_warnings():
    """The dry run calls ``training_step`` without a Trainer: Lightning's warning that
    ``self.log`` has no Trainer to log to is about the dry run, not the user's model."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*You are trying to `self\.log\(\)`.*")
        yield
