"""The ``vae-ddp audit`` command line: jsonargparse parses, as LightningCLI parses class paths.

    vae-ddp audit --model MODEL --data DATA [--model.init_args.* / --data.init_args.*]
                  [--devices 2] [--steps 3] [--dtype float64] [--accelerator cpu] [--effect_batches 32]
                  [--out DIR] [--trainer.* ...] [--config FILE]

MODEL and DATA are ``package.module.Class`` or ``path/to/file.py:Class``. DATA's ``batch_size``
is the global batch size (one device's batch); each DDP rank gets ``batch_size / devices``. What the
arguments alone tell (an unknown or abbreviated flag, a missing one, a class path of no file.py) is
refused before they are parsed ([`vae_ddp.audit.argv`][vae_ddp.audit.argv]: no torch, no user file imported);
the checks of the input before any training live in [`vae_ddp.audit.preflight`][vae_ddp.audit.preflight];
every bad input is one line ([`one_line`][vae_ddp.errors.one_line] for jsonargparse's). Exit codes:
``EPILOG`` (0 passed, 1 not, 2 bad input before any training, 3 a training run failed).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Literal, Optional, Union

from jsonargparse import ArgumentParser
from jsonargparse.typing import NotEmptyStr

from vae_ddp.audit import preflight
from vae_ddp.audit.argv import refusal
from vae_ddp.errors import Terminated, UserError, config_action, one_line

__all__ = ["main", "build_parser", "AuditParser"]

DESCRIPTION = ("Train your LightningModule on one device and with DDP from the same weights and global batch, and "
               "find which factor makes them differ.")
EPILOG = ("exit codes: 0 DDP, as you run it, trains one device's model (it computes one device's step, or differs "
          "only in which samples or independent draws it takes, or in what it logs); 1 it does not (a factor that "
          "changes what DDP trains, a step not within 2x the one-device floor, or no judgement); 2 bad input; 3 a "
          "training run failed. What each option and --trainer.NAME does: the 'Audit your own model' page.")
HELPS = {"model": "package.module.Class or path/to/file.py:Class; init arguments as --model.init_args.NAME VALUE",
         "data": "the same way; its batch_size is the global batch size (batch_size / devices per rank)"}
BASES = {"model": preflight.LightningModule, "data": preflight.LightningDataModule}


class AuditParser(ArgumentParser):
    """jsonargparse's parser named ``vae-ddp audit`` (the help ``--model.help`` prints too), whose
    help names a class made of a file as the user did (``path/to/file.py:Class``); a flag is spelled whole
    (argparse took ``--step 3`` for ``--steps 3``)."""

    def __init__(self, *args: Any, prog: str = "vae-ddp audit", exit_on_error: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, prog=prog, exit_on_error=exit_on_error, allow_abbrev=False, **kwargs)

    def format_help(self) -> str:
        return preflight.as_given(super().format_help())

    def dump(self, *args: Any, **kwargs: Any) -> str:  # --print_config: a config --config reads back
        return preflight.as_given(super().dump(*args, **kwargs), absolute=True)


def _class_flag(action: argparse.Action, key: str) -> None:
    """``--KEY VALUE`` and ``--KEY.help VALUE`` take their own value, and a config file's
    ``KEY: {class_path: ...}``, through [`class_arg`][vae_ddp.audit.preflight.class_arg]
    (``path/to/file.py:Class`` imported, the class checked) before jsonargparse reads it;
    ``--KEY.init_args.NAME`` values are left alone."""

    class ClassFlag(type(action)):  # jsonargparse's action of the flag
        def __call__(self, *args: Any, **kwargs: Any) -> Any:  # argparse's call with the command line's value
            if len(args) == 4 and args[3] in self.option_strings and isinstance(args[2], str):
                args = (*args[:2], preflight.class_arg(key, args[2]), args[3])
            return super().__call__(*args, **kwargs)

        def _check_type_(self, value: Any, **kwargs: Any) -> Any:  # a value of a config file too
            path = value.get("class_path") if hasattr(value, "get") else None
            if isinstance(path, str) and preflight.class_arg(key, path) != path:
                value = value.clone() if hasattr(value, "clone") else dict(value)
                value["class_path"] = preflight.class_arg(key, path)
            return super()._check_type_(value, **kwargs)

    action.__class__ = ClassFlag


def build_parser() -> AuditParser:
    """The audit's parser; it imports neither torch nor Lightning (``--help`` answers at once): the
    class flags check their base class by name ([`LightningModule`][vae_ddp.audit.preflight.LightningModule])
    and ``--trainer.NAME VALUE`` collects any ``Trainer`` argument, which
    [`trainer_args`][vae_ddp.audit.preflight.trainer_args] checks after parsing."""
    from vae_ddp.audit.spec import DEFAULT_STEPS, TRAINER_ARGS, TRAINER_OVERRIDDEN, TRAINER_SET

    p = AuditParser(description=DESCRIPTION, epilog=EPILOG)
    p.add_argument("--config", action=config_action(), help="read the options from this YAML file (see --print_config)")
    for key, base in BASES.items():
        p.add_subclass_arguments(base, key, required=True, help=HELPS[key])
        for option in (f"--{key}", f"--{key}.help"):
            _class_flag(p._option_string_actions[option], key)
    p.add_argument("--devices", type=int, default=2, help="DDP world size N")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps per run")
    p.add_argument("--dtype", type=Literal["float64", "float32"], default="float64", help="float64 or float32")
    p.add_argument("--accelerator", type=Literal["cpu", "gpu"], default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seed_everything", type=Optional[Union[bool, int]], default=None,
                   help="a LightningCLI config's: an integer replaces --seed")
    p.add_argument("--effect_batches", type=int, default=32, help="global batches of the effect runs (0: none)")
    p.add_argument("--out", type=NotEmptyStr, default="runs/audit", help="output folder")
    p.add_argument("--trainer", type=Optional[dict[str, Any]], default=None, metavar="NAME VALUE", help=(
        "your Trainer's arguments as LightningCLI spells them, --trainer.NAME VALUE, the same in every run ("
        + ", ".join(TRAINER_ARGS) + " and any other), but those the audit sets (" + ", ".join(TRAINER_SET)
        + "); " + ", ".join(TRAINER_OVERRIDDEN) + " are replaced by the audit's own"))
    return p


def main(argv: Optional[list[str]] = None) -> int:
    """``vae-ddp audit ARGV`` (default ``sys.argv[1:]``); returns the exit code (see the module's;
    130 for Ctrl-C, also while it imports torch and Lightning)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # the runs' guards end their trees with this process
        print("vae-ddp audit: interrupted; no verdict", file=sys.stderr)
        return 130


def _main(argv: Optional[list[str]]) -> int:
    from vae_ddp.guard import default_stall

    argv = list(sys.argv[1:] if argv is None else argv)
    cwd = os.getcwd()  # what relative paths mean: the user's code may change the working folder later
    if cwd not in sys.path:  # class paths relative to the working directory, as `python -m` allows
        sys.path.insert(0, cwd)
    try:
        default_stall()  # VAE_DDP_WATCHDOG_S: refused here, not in the runs
        if line := refusal(argv, cwd):  # what the strings tell, before the parser imports the user's classes
            raise UserError(line)
        cfg = build_parser().parse_args(argv)
    except (argparse.ArgumentError, UserError) as err:
        text = str(err) if isinstance(err, UserError) else preflight.as_given(one_line(str(err)))
        print(f"vae-ddp audit: error: {text}", file=sys.stderr)
        return 2
    except SystemExit as stop:  # --help, --model.help CLASS, --print_config
        return stop.code if isinstance(stop.code, int) else 0
    return _audit(cfg, argv, cwd)


def _audit(cfg: Any, argv: list[str], cwd: str) -> int:
    """The audit of the parsed ``cfg`` by [`run_config`][vae_ddp.audit.engine.run_config], the engine of the
    Python API too; returns the exit code. ``cwd``: the working folder the command started in (``--out``
    is relative to it, the runs start in it)."""
    from vae_ddp.audit.engine import run_config
    from vae_ddp.audit.study import earlier_report
    from vae_ddp.harness.launch import RunFailed

    out = Path(cwd, os.path.expanduser(cfg.out))
    try:
        result = run_config(cfg, out, "vae-ddp audit " + " ".join(argv), cwd=cwd)
    except UserError as err:
        print(f"vae-ddp audit: error: {err}", file=sys.stderr)
        return 2
    except RunFailed as err:  # a run failed or hung: not a verdict on the model
        _say_kept(earlier_report(out))
        print(f"vae-ddp audit: error: {err}", file=sys.stderr)
        if "find_unused_parameters" in str(err):
            print("vae-ddp audit: a module whose losses leave parameters out (a GAN's two optimizers) needs "
                  "--trainer.strategy ddp_find_unused_parameters_true", file=sys.stderr)
        return 3
    except (KeyboardInterrupt, Terminated):  # the runs' guards end their trees with this process
        _say_kept(earlier_report(out))
        raise
    return result["exit_code"]


def _say_kept(line: Optional[str]) -> None:
    """The line of [`earlier_report`][vae_ddp.audit.study.earlier_report] on stderr, if any."""
    if line:
        print(f"vae-ddp audit: {line}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
