"""The audit as a Python function: the engine of ``vae-ddp audit``, called with classes or instances.

    from vae_ddp.audit.api import audit

    result = audit(MyModule, MyDataModule, data_args={"batch_size": 32}, devices=2, steps=3)
    result.exit_code      # 0: DDP, as you run it, trains one device's model (the CLI's exit code)
    result.findings       # the factors found, each a Finding with its evidence, effect and fix
    print(result)         # the verdict and what was found, in a few lines

[`audit`][vae_ddp.audit.api.audit] builds the same parsed configuration the command line builds
(jsonargparse, the parser of ``vae_ddp.audit.cli``) and hands it to
[`run_config`][vae_ddp.audit.engine.run_config], which the command line calls too: the pre-flight
checks ([`vae_ddp.audit.preflight`][vae_ddp.audit.preflight]), then
[`study.audit`][vae_ddp.audit.study.audit]. The result is the command's ``audit.json``, typed
([`AuditResult`][vae_ddp.audit.api.AuditResult]; ``to_dict()`` is the file's content).

The ranks are the command's, under the guard. Your classes reach them by import: a class of an importable
module by its dotted name (this process's own ``sys.path`` entries are added to ``PYTHONPATH``), any other of a
file (a test file, a script) by that file ([`import_class`][vae_ddp.audit.spec.import_class]; a script keeps its
top-level work under ``if __name__ == "__main__":``); a class defined inside a function cannot be reached.
An instance travels pickled ([`user_objects`][vae_ddp.audit.user_objects]), as Lightning's spawn launcher sends it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import json
import os
import re
import shutil
import site
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from vae_ddp import zygote
from vae_ddp.audit.argv import keywords, unexpected_keywords
from vae_ddp.lightning_package import env_for, of
from vae_ddp.audit.engine import run_config
from vae_ddp.audit.user_objects import STAND_INS, saved, unpicklable
from vae_ddp.audit.spec import DEFAULT_STEPS
from vae_ddp.errors import RunFailed, UserError
from vae_ddp.utils import private_tmpdir

__all__ = ["audit", "AuditResult", "Finding", "Effect", "AuditInputError", "AuditRunFailed"]


class AuditInputError(ValueError):
    """Bad input, found before any training: the message names the argument and what to do."""


class AuditRunFailed(RuntimeError):
    """A training run of the audit failed or hung (the command's exit code 3): no verdict on the model.
    The message holds the run's label, exit code and the end of its stderr."""


@dataclass(frozen=True)
class Effect:
    """What an exposed factor changes over ``rows`` global batches from one device's weights
    ([`vae_ddp.audit.effects`][vae_ddp.audit.effects]).

    Attributes:
        kind: ``"different"`` (what DDP trains), ``"same distribution"`` (only which samples or
            draws), ``"exact"`` (the same step) or ``"inconclusive"``.
        bias: DDP's mean step off one device's, in one device's step-to-step standard deviations.
        bias_ci: its 95% interval ``(low, high)``.
        variance_ratio: DDP's step-to-step variance over one device's.
        variance_ratio_ci: its 95% interval.
        quantity: ``"gradient"`` or ``"buffers"``, the one measured as the more serious.
        rows: the global batches measured.
    """

    kind: str
    bias: float
    bias_ci: tuple[float, float]
    variance_ratio: float
    variance_ratio_ci: tuple[float, float]
    quantity: str
    rows: Optional[int]

    @classmethod
    def of(cls, d: Optional[dict]) -> Optional["Effect"]:
        if not d:
            return None
        return cls(kind=d["kind"], bias=d["bias"], bias_ci=tuple(d["bias_ci"]), variance_ratio=d["variance_ratio"],
                   variance_ratio_ci=tuple(d["variance_ratio_ci"]), quantity=d.get("quantity", "gradient"),
                   rows=d.get("rows"))


@dataclass(frozen=True)
class Finding:
    """One row of the audit's table: a factor of the registry or one of the audit's own.

    Attributes:
        factor: its key (``"batchnorm"``).
        name: its name in the report (``"BatchNorm statistics"``).
        exposed: the runs saw it.
        mechanism: for an exposed factor, what it does to the model DDP trains (``"another model"``
            makes the exit code 1, [`exit_rule`][vae_ddp.audit.exit_rule]), else None.
        evidence: what was seen (or the words for nothing seen).
        fix: the fix.
        page: its documentation page (relative to ``docs/``).
        contribution: the largest relative gradient difference from one device with every fix but
            this one's (None where not measured).
        bites: the contribution is above 2x the floor (None: not separable).
        left_after_fixes: as in ``audit.json``.
        fixed_alone: as in ``audit.json``.
        vs_batch_noise: as in ``audit.json``.
        automatic_fix: the audit's own fix removes it.
        effect: what it changes ([`Effect`][vae_ddp.audit.api.Effect]), None where not measured.
        follows: the keys of the factors it follows from, whose fixes the audit measured to close it
            (a ``buffers`` row beside draws no automatic fix serves), else None.
    """

    factor: str
    name: str
    exposed: bool
    mechanism: Optional[str]
    evidence: str
    fix: str
    page: str
    contribution: Optional[float]
    bites: Optional[bool]
    left_after_fixes: Optional[float]
    fixed_alone: Optional[float]
    vs_batch_noise: Optional[float]
    automatic_fix: bool
    effect: Optional[Effect]
    follows: Optional[tuple[str, ...]] = None


@dataclass(frozen=True)
class AuditResult:
    """The audit's verdict, typed (``to_dict()``: the ``audit.json`` the command writes).

    Attributes:
        verdict: ``"passed"`` (exit code 0) or ``"failed"`` (1).
        exit_code: 0 or 1, the command's exit code ([`exit_rule.decide`][vae_ddp.audit.exit_rule.decide]).
        exit_why: the keys of the factors that change the model DDP trains, then any other reason.
        devices: the DDP world size.
        steps: optimizer steps per run.
        dtype: the parameters' dtype.
        global_batch_size: one device's batch.
        floor: the one-device floor (the samples permuted).
        ratio_to_floor: DDP with every fix, its largest per-step gradient difference over the floor.
        grad_steps: that difference per step.
        deterministic: the floor is rounding.
        within_floor: DDP with every fix is within 2x its floor.
        checked: one [`Finding`][vae_ddp.audit.api.Finding] per factor the audit checked, found or not, ranked
            as the table ranks them (``audit.json``'s ``findings``).
        effect: Lightning's defaults as a whole ([`Effect`][vae_ddp.audit.api.Effect]) or None.
        notes: what the audit noticed beside the factors.
        report: the report's text (``tables.md``).
        out: the folder it was written to, None for a temporary folder (removed).
    """

    verdict: str
    exit_code: int
    exit_why: tuple[str, ...]
    devices: int
    steps: int
    dtype: str
    global_batch_size: int
    floor: float
    ratio_to_floor: float
    grad_steps: tuple[float, ...]
    deterministic: bool
    within_floor: bool
    checked: tuple[Finding, ...]
    effect: Optional[Effect]
    notes: tuple[str, ...]
    report: str = dataclasses.field(repr=False, compare=False)
    out: Optional[Path] = dataclasses.field(compare=False)
    _raw: str = dataclasses.field(repr=False)

    @property
    def findings(self) -> tuple[Finding, ...]:
        """The factors the audit found (``exposed``), in the table's order; the rest are in ``checked``."""
        return tuple(f for f in self.checked if f.exposed)

    def __str__(self) -> str:
        """The summary: the verdict and its exit code, why, then each factor found with its fix
        (``print(result)``); the whole report is ``report``."""
        why = f" because of {', '.join(self.exit_why)}" if self.exit_why else ""
        lines = [f"vae-ddp audit {self.verdict} (exit code {self.exit_code}){why}: DDP on {self.devices} devices "
                 f"against one device, {self.steps} steps, {self.dtype}, global batch {self.global_batch_size}"]
        lines += [f"- {f.name}: {f.evidence}" + (f"; fix: {f.fix}" if f.fix else "") for f in self.findings]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """A new copy of the command's ``audit.json`` for these inputs (``json.loads`` of it)."""
        return json.loads(self._raw)

    @classmethod
    def of(cls, result: dict, report: str = "", out: Optional[Path] = None) -> "AuditResult":
        """The typed form of ``result`` (``study.audit``'s dict or ``audit.json``'s content)."""
        from vae_ddp.audit.verdict import _name

        raw = json.dumps(result)
        d = json.loads(raw)
        keys = [f.name for f in dataclasses.fields(Finding) if f.name not in ("name", "effect", "mechanism", "follows")]
        findings = tuple(Finding(name=_name(f["factor"]), mechanism=f.get("mechanism"),
                                 effect=Effect.of(f.get("effect")), **{k: f[k] for k in keys},
                                 follows=tuple(f["follows"]) if f.get("follows") else None) for f in d["findings"])
        return cls(verdict="passed" if d["exit_code"] == 0 else "failed", exit_code=d["exit_code"],
                   exit_why=tuple(d["exit_why"]), devices=d["devices"], steps=d["steps"], dtype=d["dtype"],
                   global_batch_size=d["global_batch_size"], floor=d["floor"], ratio_to_floor=d["ratio_to_floor"],
                   grad_steps=tuple(d["grad_steps"]), deterministic=d["deterministic"], within_floor=d["within_floor"],
                   checked=findings, effect=Effect.of(d.get("effect")), notes=tuple(d.get("notes", [])),
                   report=report, out=out, _raw=raw)


Classish = Union[type, Any]


def audit(model: Classish, datamodule: Classish, *, model_args: Optional[dict] = None,
          data_args: Optional[dict] = None, devices: int = 2, steps: int = DEFAULT_STEPS, dtype: str = "float64",
          precision: Optional[str] = None, accelerator: str = "cpu", seed: int = 0, effect_batches: int = 32,
          out: Optional[Union[str, os.PathLike]] = None, progress: bool = False, **trainer_args: Any) -> AuditResult:
    """Audit ``model`` trained on ``datamodule``: ``vae-ddp audit`` with these options, in this process
    (its runs are processes of their own).

    Args:
        model: a ``LightningModule`` subclass (its ``__init__`` arguments in ``model_args``; each run builds
            it after seeding) or an instance, sent to the runs as Lightning's spawn launcher sends it (pickled,
            with its weights and attributes: every run starts from a copy,
            [`vae_ddp.audit.user_objects`][vae_ddp.audit.user_objects]); one that does not pickle is rebuilt
            from its class and its ``hparams`` or same-named attributes, else refused naming what does not pickle.
        datamodule: a ``LightningDataModule`` subclass (arguments in ``data_args``) or an instance, the
            same way (its ``batch_size`` attribute set to each run's). Its ``batch_size`` is the global batch
            size B (one device's batch); each of the ``devices`` ranks gets ``B / devices``.
        model_args: ``model``'s ``__init__`` arguments (JSON values: numbers, strings, lists, dicts),
            as ``--model.init_args.NAME``.
        data_args: ``datamodule``'s, as ``--data.init_args.NAME``.
        devices: the DDP world size N (at least 2).
        steps: optimizer steps per run (at least 1).
        dtype: ``"float64"`` or ``"float32"``.
        precision: Lightning's name, one of ``preflight.PRECISIONS``; it overrides ``dtype``.
        accelerator: ``"cpu"`` (gloo, the default) or ``"gpu"``.
        seed: the runs' seed.
        effect_batches: global batches of the effect runs (0 skips them, else at least 4).
        out: the output folder (``audit.json``, ``tables.md``, the runs' logs); None: a new temporary folder, removed
            before this returns (parallel callers never share one). While the call runs, ``TMPDIR`` is a folder of
            its own, holding that one, removed however the call ends, a SIGKILL of the caller too
            ([`private_tmpdir`][vae_ddp.utils.private_tmpdir]).
        progress: print what the command prints (progress and report); else nothing on ``sys.stdout``.
        **trainer_args: any other ``Trainer`` argument (``gradient_clip_val=1.0``), as ``--trainer.NAME VALUE``.

    Returns:
        [`AuditResult`][vae_ddp.audit.api.AuditResult]; ``to_dict()`` equals the ``audit.json`` the command
        writes for the same inputs.

    Raises:
        TypeError: ``model``/``datamodule`` is neither such a class nor an instance, an argument has the
            wrong type or a name neither audit's nor Trainer's (it names the closest), or init arguments are not JSON.
        AuditInputError: (a ``ValueError``) any bad input the command answers with exit 2, before any training.
        AuditRunFailed: a training run failed (the command's exit code 3).
    """
    __tracebackhide__ = True  # pytest shows a bad input's one line, not this function's source
    unexpected_keywords("audit", trainer_args, KEYWORDS)  # step=, data_arg=: "did you mean"
    _check_types(devices=(devices, int), steps=(steps, int), seed=(seed, int), effect_batches=(effect_batches, int),
                 progress=(progress, bool))
    _check_choice("dtype", dtype, ("float64", "float32"))
    _check_choice("accelerator", accelerator, ("cpu", "gpu"))
    if precision is not None:
        from vae_ddp.audit.preflight import PRECISIONS

        _check_choice("precision", str(precision), PRECISIONS)
        trainer_args["precision"] = str(precision)
    with _child_path():
        given_objs = (("model", model, model_args), ("data", datamodule, data_args))
        classes = {key: _class_cfg(key, obj, args) for key, obj, args in given_objs}
        travel = {key: obj for key, obj, _ in given_objs if not isinstance(obj, type) and unpicklable(obj) is None}
        given = {**classes, **{k: {"class_path": STAND_INS[k]} for k in travel}, "devices": devices, "steps": steps,
                 "dtype": dtype, "accelerator": accelerator, "seed": seed, "effect_batches": effect_batches,
                 "out": str(out or "unused"), "trainer": dict(trainer_args) or None}
        cfg = dict(_parse(given).as_dict(), **{k: classes[k] for k in travel})  # an instance's class as it is
        if accelerator == "cpu":  # outside the call's TMPDIR: it serves this process's later calls too, and its
            # imports (inductor's folder) may outlast the call; the Lightning package of the user's module
            zygote.warm("vae_ddp.audit.run", env_for(of(model if isinstance(model, type) else type(model))))
        return _audited(cfg, out, progress, travel)


def _audited(cfg: dict, out: Any, progress: bool, travel: dict) -> AuditResult:
    """The audit of ``cfg`` in a TMPDIR of its own, removed (its reaper's after a SIGKILL) with what it holds."""
    __tracebackhide__ = True
    temporary = out is None
    with private_tmpdir():
        folder = Path(tempfile.mkdtemp(prefix="vae-ddp-audit-")) if temporary else Path(out).expanduser().resolve()
        shown = contextlib.nullcontext() if progress else contextlib.redirect_stdout(io.StringIO())
        try:
            with shown:  # the report is the result's (report); the runs' own output goes to their logs
                result = run_config(cfg, folder, "vae_ddp.audit.api.audit", progress=progress,
                                    instances={k: saved(obj) for k, obj in travel.items()})
            report = (folder / "tables.md").read_text() if (folder / "tables.md").exists() else ""
        except UserError as err:
            raise AuditInputError(python_names(str(err))) from None
        except RunFailed as err:
            raise AuditRunFailed(str(err)) from None
        finally:
            if temporary:  # whatever happened: no folder left behind per call
                shutil.rmtree(folder, ignore_errors=True)
    return AuditResult.of(result, report, None if temporary else folder)


KEYWORDS = keywords(audit)  # audit's own keyword arguments, read once (the pytest helper names them too)
#: the command line's names in a pre-flight message -> the Python arguments of ``audit``
_NAMES = [(r"--model\.init_args\.(\w+)", r"model_args['\1']"), (r"--data\.init_args\.(\w+)", r"data_args['\1']"),
          (r"--model's init args", "model_args"), (r"--data's init args", "data_args"),
          (r"--trainer\.(\w+)", r"\1"),
          (r"--(devices|steps|dtype|accelerator|seed|effect_batches|out)\b", r"\1"),
          (r"--model\b", "model"), (r"--data\b", "datamodule")]


def python_names(text: str) -> str:
    """A pre-flight line (``--data.init_args.batch_size``) with the Python arguments of
    [`audit`][vae_ddp.audit.api.audit] in place of the command line's flags (``data_args['batch_size']``)."""
    for pattern, repl in _NAMES:
        text = re.sub(pattern, repl, text)
    return text


def _check_types(**given: tuple) -> None:
    __tracebackhide__ = True
    for name, (value, kind) in given.items():
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise TypeError(f"{name} must be {kind.__name__}, got {type(value).__name__} {value!r}")


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    __tracebackhide__ = True
    if value not in choices:
        raise AuditInputError(f"{name}={value!r} is not one the audit runs: give one of "
                              f"{', '.join(map(repr, choices))}")


_BASE = {"model": ("pytorch_lightning.core.module.LightningModule", "model", "model_args", "LightningModule"),
         "data": ("pytorch_lightning.core.datamodule.LightningDataModule", "datamodule", "data_args",
                  "LightningDataModule")}


def _class_cfg(key: str, obj: Any, args: Optional[dict]) -> dict:
    """``{"class_path", "init_args"}`` of ``obj`` (a class and ``args``, or an instance), the class path
    one the runs import ([`class_arg`][vae_ddp.audit.preflight.class_arg]: a file's registered)."""
    __tracebackhide__ = True
    from vae_ddp.audit import preflight
    from vae_ddp.lightning_package import is_a  # pytorch_lightning's base or lightning.pytorch's

    base, name, args_name, base_name = _BASE[key]
    if args is not None and not isinstance(args, dict):
        raise TypeError(f"{args_name} must be a dict of {name}'s __init__ arguments, got {type(args).__name__}")
    if isinstance(obj, type):
        if not is_a(obj, base):
            raise TypeError(f"{name}={obj.__qualname__} is not a {base_name} subclass: give your {base_name} "
                            "class (its __init__ arguments in " + args_name + ") or an instance")
        cls, init_args = obj, dict(args or {})
        _check_init_args(cls, init_args, args_name)
    elif is_a(type(obj), base):
        if args:
            raise TypeError(f"{args_name} is for a class; {name} is an instance, built with its own arguments: give "
                            f"the class and {args_name}, or the instance alone")
        cls, init_args = type(obj), _init_args(obj, name, args_name)
    else:
        raise TypeError(f"{name} must be a {base_name} subclass or an instance of one, got {type(obj).__name__}")
    try:
        init_args = json.loads(json.dumps(init_args))
    except (TypeError, ValueError) as err:
        raise TypeError(f"{args_name}: the audit's runs are processes of their own, rebuilt from JSON arguments, and "
                        f"{err}: pass numbers, strings, lists or dicts (build the object inside __init__)") from None
    try:
        path = preflight.class_arg(key, _where(cls, name))
    except UserError as err:
        raise AuditInputError(python_names(str(err))) from None
    return {"class_path": path, "init_args": init_args}


def _check_init_args(cls: type, init_args: dict, args_name: str) -> None:
    """Refuse a key of ``init_args`` that ``cls.__init__`` does not take (unless it takes ``**kwargs``), in the
    command line's words (``--model.init_args.hiden: Classifier has no init argument 'hiden'``); jsonargparse
    said only ``model: expected null, got "{...}"`` for it."""
    __tracebackhide__ = True
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    taken = [n for n, p in params.items() if n != "self" and p.kind is not p.VAR_POSITIONAL]
    unknown = [k for k in init_args if k not in taken]
    if unknown:
        raise AuditInputError(f"{args_name}['{unknown[0]}']: {cls.__qualname__} has no init argument "
                              f"'{unknown[0]}' (it takes: {', '.join(taken) or 'none'})")


def _init_args(obj: Any, name: str, args_name: str) -> dict:
    """The init arguments of an instance, as far as they are recovered: its ``hparams_initial``, else its
    attributes of the parameters' names (``self.lr = lr``); a datamodule's ``batch_size`` attribute. All of them,
    where the instance does not pickle (rebuilt from them), else AuditInputError naming what does not pickle."""
    __tracebackhide__ = True
    cls, saved_args = type(obj), dict(getattr(obj, "hparams_initial", None) or {})
    params = [p for p in inspect.signature(cls.__init__).parameters.values()
              if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    found = {p.name: saved_args[p.name] if p.name in saved_args else getattr(obj, p.name) for p in params
             if p.name in saved_args or isinstance(getattr(obj, p.name, None), (bool, int, float, str))}
    if name == "datamodule" and isinstance(getattr(obj, "batch_size", None), int):
        found["batch_size"] = obj.batch_size
    missing, problem = [p.name for p in params if p.name not in found], unpicklable(obj)
    if missing and problem:
        raise AuditInputError(
            f"{name}: the {cls.__name__} instance does not pickle ({problem}) and its init arguments cannot be "
            f"recovered ({', '.join(missing)}): make it pickle, pass the class and its arguments, {name}="
            f"{cls.__name__}, {args_name}={{...}}, or call self.save_hyperparameters() in its __init__")
    return found


def _where(cls: type, name: str) -> str:
    """How the runs import ``cls``: its dotted path when a new interpreter finds its module by that name
    (on this process's ``sys.path``) as the same file and each part of the name is an identifier (a module
    ``2stage``, imported with ``importlib``, has no class path), else ``path/to/file.py:Class``."""
    __tracebackhide__ = True
    if "." in cls.__qualname__ or "<" in cls.__qualname__:
        raise AuditInputError(f"{name}={cls.__qualname__} is defined inside a function or class: the audit's runs "
                              "import it, so define it at the top level of a module or file")
    try:
        file = inspect.getsourcefile(cls)
    except TypeError:
        file = None
    module = sys.modules.get(cls.__module__)
    dotted = all(part.isidentifier() for part in cls.__module__.split("."))  # what a class path can name: not 2stage
    if dotted and cls.__module__ != "__main__" and module is not None and \
            getattr(module, cls.__qualname__, None) is cls:
        spec = _found(cls.__module__)
        if spec is not None and spec.origin and file and os.path.samefile(spec.origin, file):
            return f"{cls.__module__}.{cls.__qualname__}"
    if file is None or not file.endswith(".py"):
        raise AuditInputError(f"{name}={cls.__qualname__} has no source file the audit's runs can import: define it "
                              "in a .py file")
    return f"{file}:{cls.__qualname__}"


def _found(name: str) -> Any:
    """The spec a new interpreter with this ``sys.path`` finds for module ``name`` (not ``sys.modules``'
    entry: a module loaded from a file under a made-up name is there but not found), or None."""
    from importlib.machinery import PathFinder

    parent, _, last = name.rpartition(".")
    if parent and _found(parent) is None:
        return None
    path = getattr(sys.modules.get(parent), "__path__", None) if parent else sys.path
    if path is None:
        return None
    try:
        return PathFinder.find_spec(last, list(path))
    except (ImportError, ValueError):
        return None


def _parse(given: dict) -> Any:
    """The audit parser's namespace of ``given`` (the command line's keys), as ``vae-ddp audit`` parses it."""
    __tracebackhide__ = True
    from vae_ddp.audit.cli import build_parser
    from vae_ddp.errors import one_line

    try:
        return build_parser().parse_object(given)
    except UserError as err:
        raise AuditInputError(python_names(str(err))) from None
    except Exception as err:  # noqa: BLE001 - jsonargparse's ArgumentError: one line of it
        raise AuditInputError(python_names(one_line(str(err)))) from None


def _own_paths() -> list[str]:
    """This process's ``sys.path`` entries outside the interpreter's own (its prefix, site-packages)."""
    own = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sysconfig.get_paths()["stdlib"])}
    own |= {os.path.realpath(p) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    paths = []
    for p in sys.path:
        real = os.path.realpath(p or os.getcwd())
        if os.path.isdir(real) and not any(real == o or real.startswith(o + os.sep) for o in own):
            paths.append(real)
    return list(dict.fromkeys(paths))


@contextlib.contextmanager
def _child_path() -> Iterator[None]:
    """``PYTHONPATH`` with this process's own ``sys.path`` entries first, while the audit runs (its
    runs are new interpreters that import the user's classes by name)."""
    before = os.environ.get("PYTHONPATH")
    paths = _own_paths() + ([before] if before else [])
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before
