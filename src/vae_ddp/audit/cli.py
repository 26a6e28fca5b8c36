"""The ``vae-ddp audit`` command line (jsonargparse, as LightningCLI parses class paths).

    vae-ddp audit --model MODEL --data DATA [--model.init_args.* / --data.init_args.*]
                  [--devices 2] [--steps 4] [--dtype float64] [--accelerator cpu] [--out DIR]
                  [--trainer.strategy ddp_find_unused_parameters_true] [--trainer.* ...]

MODEL and DATA are ``package.module.Class`` or ``path/to/file.py:Class``. DATA's
``batch_size`` is the global batch size (one device's batch); each DDP rank gets
``batch_size / devices``. Exit codes: 0 DDP with the fixes, started at every step from one
device's weights, computes a gradient within 2x the one-device floor; 1 it does not
(something unexplained, a factor the audit cannot fix by itself, such as a loss averaged over
a variable number of items, or random draws that do not follow their sample), 2 bad input
(one line, before any training), 3 a training run failed (its first error line, and where
every rank's log is).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Literal, Optional

from vae_ddp.errors import UserError, one_line

#: global batches of the user's training loader that the one-process checks look at
STATIC_BATCHES = 4

__all__ = ["main", "check"]


def _parser(light: bool = False):
    """The audit's parser. ``light``: ``--model``/``--data`` as plain class paths, for ``--help``
    without importing torch or Lightning (seconds); otherwise jsonargparse's subclass arguments
    of ``LightningModule``/``LightningDataModule``, with their ``init_args``. The other options
    are the same in both (``tests/test_audit.py`` compares them)."""
    from jsonargparse import ArgumentParser

    from vae_ddp.audit.spec import TRAINER_ARGS, AuditRun

    p = ArgumentParser(prog="vae-ddp audit", exit_on_error=False, description=(
        "Train your LightningModule on one device and with DDP from the same weights and global batch, "
        "and find which factor makes them differ."), epilog=(
        "exit codes: 0 DDP with the fixes, started at every step from one device's weights, computes one device's "
        "whole step (gradient, learning rate, update, buffers, every rank's parameters) within 2x the one-device "
        "floor; 1 it does not (unexplained, a factor that needs a change in your code, or random draws that do "
        "not follow their sample); 2 bad input; 3 a training run failed"))
    helps = {"model": "your LightningModule: package.module.Class or path/to/file.py:Class; its __init__ arguments "
                      "as --model.init_args.NAME VALUE or --model.NAME VALUE (listed by --model.help CLASS)",
             "data": "your LightningDataModule, given the same way; its batch_size (--data.init_args.batch_size) is "
                     "the global batch size: each of the --devices ranks gets batch_size / devices"}
    if light:
        for key, text in helps.items():
            p.add_argument(f"--{key}", type=str, required=True, metavar="CLASS", help=text)
    else:
        from pytorch_lightning import LightningDataModule, LightningModule

        p.add_subclass_arguments(LightningModule, "model", required=True, help=helps["model"])
        p.add_subclass_arguments(LightningDataModule, "data", required=True, help=helps["data"])
    p.add_argument("--devices", type=int, default=2, help="DDP world size N")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    p.add_argument("--dtype", type=Literal["float64", "float32"], default="float64",
                   help="float64 (rounding hides nothing) or float32")
    p.add_argument("--accelerator", type=Literal["cpu", "gpu"], default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--effect_batches", type=int, default=AuditRun.effect_batches,
                   help="global batches one device and DDP each take from one device's weights to tell what changes "
                        "what DDP trains (a bias, a noise ratio) from what changes only which samples or draws it "
                        "takes; 0 skips it (each such run is --effect_batches steps)")
    p.add_argument("--out", type=str, default="runs/audit", help="output folder")
    for name, (hint, default, text) in TRAINER_ARGS.items():  # the user's Trainer arguments, as LightningCLI spells them
        p.add_argument(f"--trainer.{name}", type=hint, default=default, help=text)
    return p


def _resolve_files(argv: list[str]) -> tuple[list[str], dict[str, Optional[str]], dict[str, str]]:
    """Turn ``--model path/file.py:Class`` (and ``--model.help path/file.py:Class``) into an
    importable class path; remember the files, and each resolved path's spelling as given."""
    from vae_ddp.audit.spec import resolve_class_arg

    out, files, given = [], {"model": None, "data": None}, {}
    i = 0
    while i < len(argv):
        a = argv[i]
        for key in ("model", "data", "model.help", "data.help"):
            spaced = a == f"--{key}" and i + 1 < len(argv) and ".py:" in argv[i + 1]
            joined = a.startswith(f"--{key}=") and ".py:" in a
            if not (spaced or joined):
                continue
            value = argv[i + 1] if spaced else a.split("=", 1)[1]
            try:  # the same one line in both spellings
                path, file = resolve_class_arg(value)
            except ValueError as err:
                raise UserError(f"--{key}: {err}") from None
            except Exception as err:  # noqa: BLE001 - the user's file fails to import
                first = str(err).splitlines()[0] if str(err) else ""
                raise UserError(f"--{key}: {value} does not import: {type(err).__name__}: {first}") from None
            if key in files:
                files[key] = file
            given[path] = value
            out += [a, path] if spaced else [f"--{key}={path}"]
            i += 2 if spaced else 1
            break
        else:
            out.append(a)
            i += 1
    return out, files, given


def _check_class_paths(argv: list[str], given: Optional[dict[str, str]] = None) -> None:
    """``--model X`` / ``--data X`` must name an importable LightningModule / LightningDataModule."""
    from importlib import import_module

    from pytorch_lightning import LightningDataModule, LightningModule

    base = {"model": LightningModule, "data": LightningDataModule}
    pairs = [(a[2:], argv[i + 1]) for i, a in enumerate(argv[:-1]) if a in ("--model", "--data")]
    pairs += [tuple(a[2:].split("=", 1)) for a in argv if a.startswith(("--model=", "--data="))]
    for key, path in pairs:
        if path.startswith(("{", "-")) or path.endswith((".yaml", ".yml", ".json")):
            continue
        shown = (given or {}).get(path, path)  # the user's file.py:Class, not the module made of it
        module, _, name = path.rpartition(".")
        try:
            mod = import_module(module) if module else None
        except Exception as err:  # noqa: BLE001 - the user's module fails to import
            raise UserError(f"--{key} {shown} does not import ({type(err).__name__}: {err}): give "
                            "package.module.Class or path/to/file.py:Class") from None
        if mod is not None and not hasattr(mod, name):
            where = shown.rpartition(":")[0] if shown != path else module
            raise UserError(f"--{key} {shown} does not import ({where} defines no {name}): give "
                            "package.module.Class or path/to/file.py:Class")
        cls = getattr(mod, name, None)
        if not (isinstance(cls, type) and issubclass(cls, base[key])):
            raise UserError(f"--{key} {shown} is not a {base[key].__name__} subclass: give "
                            "package.module.Class or path/to/file.py:Class")


def _class_help(parser, argv: list[str], given: dict[str, str]) -> int:
    """``--model.help CLASS``: jsonargparse's help for the class's init arguments, with the
    class as the user named it (``path/to/file.py:Class``) and this command's name."""
    import contextlib
    import io

    text, code = io.StringIO(), 0
    with contextlib.redirect_stdout(text):
        try:
            parser.parse_args(argv)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 0
        except Exception as err:  # noqa: BLE001 - jsonargparse's ArgumentError: one line of it
            raise UserError(_as_given(one_line(str(err)), given)) from None
    # jsonargparse names the program after sys.argv[0] there
    sys.stdout.write(_as_given(re.sub(r"^usage: \S+ ", "usage: vae-ddp audit ", text.getvalue(), count=1), given))
    return code


def _as_given(text: str, given: dict[str, str]) -> str:
    """``text`` with each class made of a file (``_vae_ddp_user_….Class``) and its module named
    as the user did (``path/to/file.py:Class``, ``path/to/file.py``)."""
    for path, value in given.items():
        text = text.replace(path, value).replace(path.rpartition(".")[0], value.rpartition(":")[0])
    return text


#: ``--trainer.precision`` values the audit runs (Lightning's names): the parameters' dtype follows
#: (float64 for 64-true, else float32), overriding --dtype.
PRECISIONS = ("64-true", "32-true", "bf16-mixed", "16-mixed")


def _trainer_args(given: dict) -> dict:
    """The ``--trainer.*`` values that differ from Lightning's defaults; ``strategy`` checked.

    Raises:
        UserError: a strategy that is not one of ``DDP_STRATEGIES``.
    """
    import torch
    from pytorch_lightning import Trainer

    from vae_ddp.audit.spec import DDP_STRATEGIES

    defaults = {k: v.default for k, v in inspect.signature(Trainer).parameters.items()}
    args = {k: v for k, v in given.items() if v is not None and v != defaults.get(k)}
    strategy = args.get("strategy", "ddp")
    if not isinstance(strategy, str) or strategy not in DDP_STRATEGIES:
        raise UserError(f"--trainer.strategy {strategy!r} is not a DDP strategy the audit launches: give one of "
                        f"{', '.join(DDP_STRATEGIES)}")
    if args.get("accumulate_grad_batches", 1) < 1:  # Lightning takes 0 and fails at the first step
        raise UserError(f"--trainer.accumulate_grad_batches must be at least 1, got {args['accumulate_grad_batches']}")
    if args.get("precision") is not None and str(args["precision"]) not in PRECISIONS:
        raise UserError(f"--trainer.precision {args['precision']!r} is not one the audit compares: give one of "
                        f"{', '.join(PRECISIONS)}")
    rest = {k: v for k, v in args.items() if k not in {"strategy", "precision"}}
    loggers = [logging.getLogger(n) for n in ("pytorch_lightning", "lightning_fabric", "lightning.pytorch")]
    levels = [lg.level for lg in loggers]
    deterministic = torch.are_deterministic_algorithms_enabled()  # Trainer(deterministic=True) sets it
    try:  # Lightning's own checks of the values, here rather than in every run (its chatter silenced)
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, **rest)
    except Exception as err:  # noqa: BLE001 - Lightning's MisconfigurationException/ValueError: its first line
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(f"--trainer.{'/'.join(rest)}: {first}") from None
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        torch.use_deterministic_algorithms(deterministic)
    return args


#: What Lightning says when a module calls a Trainer-attached method (``self.all_gather``,
#: ``self.trainer``, ...) without one (``LightningModule.trainer``, Lightning 2.x).
_NO_TRAINER = "is not attached to a `Trainer`"


def check(run, data_cls: type, model_cls: type) -> tuple[list[dict], list[str]]:
    """Bad input before any training: one [`UserError`][vae_ddp.errors.UserError] line each.

    Returns the findings of the one-process checks ([`static_findings`][vae_ddp.audit.static.static_findings])
    and notes: a ``training_step`` that needs a Trainer (``self.all_gather``, ...) skips the
    checks that call it (the DDP runs answer for it) instead of being refused."""

    import torch
    from pytorch_lightning import LightningModule

    if run.devices < 2:
        raise UserError(f"--devices must be at least 2 (the DDP world size to compare with one device), got {run.devices}")
    if run.steps < 1:
        raise UserError(f"--steps must be at least 1, got {run.steps}")
    if run.effect_batches != 0 and run.effect_batches < 4:
        raise UserError(f"--effect_batches must be 0 (skip) or at least 4, got {run.effect_batches}")
    if model_cls.training_step is LightningModule.training_step:
        raise UserError(f"{model_cls.__name__} has no training_step: the audit trains it, so define one")
    if "batch_size" not in inspect.signature(data_cls).parameters:
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
        dm = data_cls(**dict(run.data.get("init_args", {}), batch_size=run.global_batch_size))
    except Exception as err:  # noqa: BLE001 - the user's class: its first line
        raise UserError(f"{data_cls.__name__}(...) fails ({type(err).__name__}: {_first(err)}): check --data's "
                        "init args") from None
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
        first = str(err).splitlines()[0] if str(err) else ""
        raise UserError(f"{data_cls.__name__} yields no batch ({type(err).__name__}: {first}): check its setup() "
                        "and train_dataloader()") from None
    size = _dataset_size(dm)
    if size is not None and size < run.global_batch_size:
        raise UserError(f"{data_cls.__name__}'s training set holds {size} samples, fewer than one global batch of "
                        f"{run.global_batch_size}: give more data or a smaller --data.init_args.batch_size")
    with torch.random.fork_rng():  # the same weights and draws on every audit of this seed, as the runs'
        torch.manual_seed(run.seed)
        return _check_model(run, model_cls, dm, batches, batch)


def _check_model(run, model_cls: type, dm, batches: list, batch) -> tuple[list[dict], list[str]]:
    """Build the module, try its training_step on one batch without a Trainer, run the one-process checks."""
    import torch

    from vae_ddp.fixes.factor import cast_batch as _cast
    try:
        model = model_cls(**run.model.get("init_args", {}))
    except Exception as err:  # noqa: BLE001 - the user's class: its first line
        raise UserError(f"{model_cls.__name__}(...) fails ({type(err).__name__}: {_first(err)}): check --model's "
                        "init args") from None
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
        findings, notes = _static(model, dm, batches, run)
        return findings + _attention(layers), notes
    return _static(model, dm, batches, run)


def _dry_run(model, batch) -> list[str]:
    """One ``training_step`` on one batch, the caller's generator untouched; returns the layers that
    drew attention dropout inside ``scaled_dot_product_attention`` ([`attention_dropout_layers`][vae_ddp.audit.draws.attention_dropout_layers])."""
    import torch

    from vae_ddp.audit.draws import attention_dropout_layers

    with torch.random.fork_rng(), _no_trainer_warnings():
        return attention_dropout_layers(model, lambda: model.training_step(batch, 0))


def _attention(layers: list[str]) -> list[dict]:
    """The audit's item for attention dropout no run can key to a sample (none without such layers)."""
    return [{"attention_layers": layers}] if layers else []


def _with_a_trainer(run, model_cls: type, model, dm, batches: list, batch, dtype) -> tuple[list[dict], list[str]]:
    """The one-process checks of a ``training_step`` that reads ``self.trainer`` (its world size, an
    ``all_gather``): with a one-device ``Trainer`` attached (``self.log`` a no-op: no loop collects it),
    so that a loss that couples the samples is still found (a flag the DDP runs then clear for a loss
    that gathers over the global batch). A step that needs more of a fit (its optimizers, a datamodule)
    skips the checks with a note: the DDP runs compare it."""
    from pytorch_lightning import Trainer

    from vae_ddp.fixes.factor import cast_batch as _cast

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
    model.log = model.log_dict = lambda *args, **kwargs: None
    try:
        layers = _dry_run(model, _cast(batch, dtype))
        findings, notes = _static(model, dm, batches, run)
        return findings + _attention(layers), notes
    except Exception:  # noqa: BLE001 - the user's step needs a fitting Trainer: the DDP runs judge it
        findings, notes = _static(model, dm, [], run)  # the dataset checks only
        return findings, [f"{model_cls.__name__}.training_step needs a fitting Trainer (e.g. its optimizers): the "
                          "one-process check of the loss reduction was skipped; the DDP runs compare it", *notes]
    finally:
        del model.log, model.log_dict
        model.trainer = None


def _static(model, dm, batches: list, run) -> tuple[list[dict], list[str]]:
    """[`static_findings`][vae_ddp.audit.static.static_findings], or, when the user's batch or
    step does not lend itself to them (a batch type it cannot split, an iterable dataset, ...),
    none and a note: the DDP runs still judge the model."""
    from vae_ddp.audit.static import static_findings

    try:
        with _no_trainer_warnings():
            found = static_findings(model, dm, batches, run.devices)
        return [f for f in found if "note" not in f], [f["note"] for f in found if "note" in f]
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


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:  # before anything imports torch
        _parser(light=True).print_help()
        return 0
    from vae_ddp.harness.launch import RunFailed

    if os.getcwd() not in sys.path:  # class paths relative to the working directory, as `python -m` allows
        sys.path.insert(0, os.getcwd())
    try:
        argv, files, given = _resolve_files(argv)
        _check_class_paths(argv, given)
        parser = _parser()
        if any(a.startswith(("--model.help", "--data.help")) for a in argv):
            return _class_help(parser, argv, given)
        try:
            cfg = parser.parse_args(argv)
        except Exception as err:  # jsonargparse's ArgumentError: one line of it
            line = one_line(str(err))
            # argparse names a missing flag by its key ("required: model"): name it as it is typed
            line = re.sub(r"(arguments are required: )(.*)", lambda m: m.group(1) + ", ".join(
                k if k.startswith("-") else f"--{k}" for k in m.group(2).split(", ")), line)
            if re.match(r"unrecognized arguments: .*--trainer\.", line):  # a Trainer argument the audit sets itself
                from vae_ddp.audit.spec import TRAINER_ARGS

                line += (f" (the audit passes on --trainer.{', --trainer.'.join(TRAINER_ARGS)}; it sets the devices "
                         "(--devices) and the steps (--steps) itself)")
            raise UserError(line) from None
        from vae_ddp.audit.spec import AuditRun, import_class
        from vae_ddp.audit.study import audit
        from vae_ddp.utils import out_folder_lock

        d = cfg.as_dict()
        model = {"class_path": d["model"]["class_path"], "init_args": dict(d["model"].get("init_args") or {})}
        data = {"class_path": d["data"]["class_path"], "init_args": dict(d["data"].get("init_args") or {})}
        model_cls, data_cls = import_class(model["class_path"]), import_class(data["class_path"])
        gbs = data["init_args"].get("batch_size")
        if gbs is None:
            default = inspect.signature(data_cls).parameters.get("batch_size")
            gbs = None if default is None or default.default is inspect.Parameter.empty else default.default
        trainer = _trainer_args(d.get("trainer") or {})
        precision = trainer.get("precision")
        dtype = cfg.dtype if precision is None else "float64" if str(precision) == "64-true" else "float32"
        run = AuditRun(model=model, data=data, model_file=files["model"], data_file=files["data"],
                       devices=cfg.devices, global_batch_size=int(gbs or 0), steps=cfg.steps, dtype=dtype,
                       accelerator=cfg.accelerator, seed=cfg.seed, trainer=trainer, effect_batches=cfg.effect_batches)
        static, notes = check(run, data_cls, model_cls)
        out = Path(cfg.out)
        try:
            out.mkdir(parents=True, exist_ok=True)
            probe = out / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as err:
            raise UserError(f"--out {out} is not writable ({err.strerror}): choose another folder") from None
        with out_folder_lock(out, "vae-ddp audit " + " ".join(argv)):
            result = audit(run, out, static=static, notes=notes)
    except UserError as err:
        print(f"vae-ddp audit: error: {err}", file=sys.stderr)
        return 2
    except RunFailed as err:  # a run failed or hung: not a verdict on the model
        print(f"vae-ddp audit: error: {err}", file=sys.stderr)
        if "find_unused_parameters" in str(err):
            print("vae-ddp audit: a module whose losses leave parameters out (a GAN's two optimizers) needs "
                  "--trainer.strategy ddp_find_unused_parameters_true", file=sys.stderr)
        return 3
    except KeyboardInterrupt:  # the runs' guards end their trees with this process
        print("vae-ddp audit: interrupted; no verdict", file=sys.stderr)
        return 130
    return 0 if result["within_floor"] else 1


if __name__ == "__main__":
    sys.exit(main())
