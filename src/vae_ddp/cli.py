"""``vae-ddp``: a thin command line over the library, built with jsonargparse.

A subcommand is a typed function registered once in `vae_ddp.cli.commands()`: each
parameter becomes a flag (``--name-with-dashes``, typed and checked by its annotation;
``Literal`` types give the choices), a parameter ``base: RunSpec`` becomes the flags of the
[`RunSpec`][vae_ddp.harness.configs.RunSpec] fields (so every fix of the factor registry is a switch:
``--noise``, ``--sync-bn``, ``--sampler``, ``--sync-dist-logging``; ``--exact`` turns all on), and
``out_dir`` becomes ``--out``. Every subcommand takes ``--config FILE`` and ``--print_config``.

Bad input gets one line on stderr (``vae-ddp: error: ...``) and exit code 2 before any
training; a failed run (any rank) gets its error and exit code 1.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional

from vae_ddp.errors import UserError, input_error

# The studies (torch, Lightning: seconds to import) are imported when a parser is built, so
# that `vae-ddp audit --help` answers without them.

__all__ = ["main", "main_captured", "build_parser", "Command", "commands", "register"]


@dataclass
class Command:
    """One subcommand: a typed function and how its parameters appear on the command line.

    Attributes:
        function: the study; ``base: RunSpec`` and ``out_dir: Path`` parameters are filled from
            the RunSpec flags and ``--out``, every other parameter from its own flag.
        help: one line for ``vae-ddp --help``.
        out: default of ``--out``.
        defaults: defaults of flags (RunSpec fields or parameters) for this subcommand.
        types: annotations that replace a parameter's own (e.g. ``Literal`` choices).
        hide: RunSpec fields this subcommand does not take.
        seed: add ``--seed`` (the run's seed, ``RunSpec.seeds = [seed]``).
        switches: add the fix switches of the factor registry and ``--exact`` (False for studies
            that set the fixes themselves).
    """

    function: Callable
    help: str
    out: str = "runs/out"
    defaults: dict = field(default_factory=dict)
    types: dict = field(default_factory=dict)
    hide: frozenset = frozenset()
    seed: bool = True
    switches: bool = True


#: RunSpec fields that are set by the studies, not by the command line.
INTERNAL = frozenset({"config", "seeds", "label", "save_params", "record_indices", "permute_seed", "steps_file",
                      "teacher_forced"})
_COMMANDS: dict[str, Callable[[], Command]] = {}


def register(name: str) -> Callable:
    """Decorator: ``@register("name")`` on a function returning the [`Command`][vae_ddp.cli.Command]
    (called when the parser is built, so studies are imported only then)."""
    def deco(make: Callable[[], Command]) -> Callable[[], Command]:
        _COMMANDS[name] = make
        return make
    return deco


def commands() -> dict[str, Command]:
    """Every registered subcommand, by name."""
    return {name: make() for name, make in _COMMANDS.items()}


@register("compare")
def _compare() -> Command:
    from vae_ddp.harness.configs import CONFIGS
    from vae_ddp.studies.compare import compare

    return Command(compare, "train single, ddp and dp side by side (the main job)", out="runs/compare",
                   defaults={"steps": 60, "global_batch_size": 256, "val_every": 10, "configs": list(CONFIGS)},
                   types={"configs": list[Literal[CONFIGS]]})


@register("equivalence")
def _equivalence() -> Command:
    from jsonargparse.typing import PositiveInt

    from vae_ddp.studies.equivalence import equivalence

    return Command(equivalence, "all fixes on: does ddp match single to the last digits?", out="runs/equivalence",
                   defaults={"steps": 100, "global_batch_size": 64, "world_sizes": [2, 4]},
                   types={"world_sizes": list[PositiveInt]}, hide=frozenset({"devices", "dp_mode"}), switches=False)


@register("ablation")
def _ablation() -> Command:
    from vae_ddp.studies.ablation import ablation

    return Command(ablation, "from the exact configuration, undo one fix at a time", out="runs/ablation",
                   defaults={"steps": 100, "global_batch_size": 64}, hide=frozenset({"dp_mode"}), switches=False)


@register("seeds")
def _seeds() -> Command:
    from vae_ddp.studies.seeds import STUDY_CONFIGS, seed_study

    return Command(seed_study, "the statistical study: many seeds of single, ddp, fixed ddp and dp",
                   out="runs/seeds", seed=False,
                   defaults={"steps": 100, "global_batch_size": 64, "val_every": 0, "num_seeds": 10,
                             "configs": ["single", "ddp", "ddp+fixed", "dp"]},
                   types={"configs": list[Literal[STUDY_CONFIGS]]})


@register("long-horizon")
def _long_horizon() -> Command:
    from vae_ddp.studies.long_horizon import long_horizon

    return Command(long_horizon, "thousands of steps: does noise shared across ranks shift the KL?",
                   out="runs/long-horizon", seed=False)


@register("report-scale")
def _report_scale() -> Command:
    from vae_ddp.data import DATASETS
    from vae_ddp.model import MODELS
    from vae_ddp.studies.report_scale import VARIANTS, report_scale

    return Command(report_scale, "the report's scale (ResNet-18, 2 x 128): each factor's one-step gradient "
                   "difference over batch-to-batch noise, and the logged KL", out="runs/report-scale", seed=False,
                   types={"variants": list[Literal[tuple(VARIANTS)]], "data": Literal[DATASETS],
                          "model": Literal[MODELS], "accelerator": Literal["cpu", "gpu"]})


# --- parser ----------------------------------------------------------------------------------------

def _help_of(obj: Any) -> dict[str, str]:
    """Parameter/attribute descriptions of a docstring (Google style), one line each."""
    import docstring_parser

    doc = docstring_parser.parse(inspect.getdoc(obj) or "")
    out = {}
    for p in doc.params:
        text = re.sub(r"\[`([^`]+)`\]\[[^\]]+\]", r"\1", " ".join((p.description or "").split()))
        out[p.arg_name] = text.replace("``", "")
    return out


def _add(parser, name: str, hint: Any, default: Any, help: str) -> None:
    from vae_ddp.harness.configs import flag

    kwargs: dict[str, Any] = dict(dest=name, default=default, help=help.replace("%", "%%"))
    names = [flag(name)]
    if "-" in names[0][2:]:
        names.append("--" + name)  # the config file's key works as a flag too
    if hint is bool:
        kwargs["action"] = "store_true"
    elif typing.get_origin(hint) is list:
        kwargs.update(type=typing.get_args(hint)[0], nargs="+")
    else:
        kwargs["type"] = hint
    parser.add_argument(*names, **kwargs)


def _subparser(name: str, cmd: Command, spec_cls: type):
    from jsonargparse import ArgumentParser

    from vae_ddp.fixes import registry

    p = ArgumentParser(prog=f"vae-ddp {name}", description=cmd.help, exit_on_error=False)
    p.add_argument("--config", action="config", help="read the options from this YAML file (--print_config writes one)")
    sig = inspect.signature(cmd.function)
    try:
        hints = typing.get_type_hints(cmd.function)
    except (NameError, TypeError):  # an annotation only importable under TYPE_CHECKING: parse as YAML
        hints = {}
    helps = _help_of(cmd.function)
    if "base" in sig.parameters:
        spec_hints, spec_help = typing.get_type_hints(spec_cls), _help_of(spec_cls)
        hide = cmd.hide | INTERNAL | (frozenset() if cmd.switches else {f.field for f in registry.switches()})
        for f in dataclasses.fields(spec_cls):
            if f.name in hide:
                continue
            default = cmd.defaults.get(f.name, f.default)
            _add(p, f.name, spec_hints[f.name], default, spec_help.get(f.name, ""))
        if cmd.seed:
            _add(p, "seed", int, cmd.defaults.get("seed", 0), "the run's seed (seed_everything)")
        if "exact" not in sig.parameters and cmd.switches:
            p.add_argument("--exact", action="store_true", help="turn every fix on (RunSpec.exact())")
    for pname, param in sig.parameters.items():
        if pname == "base":
            continue
        if pname == "out_dir":
            p.add_argument("--out", dest="out_dir", type=Path, default=Path(cmd.out), help="output folder")
            continue
        hint = cmd.types.get(pname, hints.get(pname, Any))  # unannotated: parsed as YAML
        default = cmd.defaults.get(pname, None if param.default is inspect.Parameter.empty else param.default)
        text = helps.get(pname, "")
        if pname == "exact":
            text = text or "turn every fix on (RunSpec.exact()) for single and ddp"
        _add(p, pname, hint, default, text)
    return p


def build_parser(spec_cls: Optional[type] = None):
    """The ``vae-ddp`` parser (jsonargparse), one subcommand per registered [`Command`][vae_ddp.cli.Command];
    ``spec_cls``: RunSpec (default) or a subclass with more fields (tests add a factor's switch this way)."""
    from jsonargparse import ArgumentParser

    from vae_ddp.harness.configs import RunSpec

    spec_cls = spec_cls or RunSpec

    parser = ArgumentParser(prog="vae-ddp", exit_on_error=False, description=(
        "Why DDP on N devices with per-device batch B/N does not reproduce one device with batch B, "
        "measured on the lightning-bolts CIFAR-10 VAE."),
        epilog="vae-ddp audit --model MODEL --data DATA ...: audit your own LightningModule (vae-ddp audit --help)")
    sub = parser.add_subcommands(dest="command")
    for name, cmd in commands().items():
        sub.add_subcommand(name, _subparser(name, cmd, spec_cls), help=cmd.help)
    return parser


# --- errors ----------------------------------------------------------------------------------------

_KEY = re.compile(r'Parser key "(?:[\w-]+\.)?(\w+)"(?: element \d+)?:\s*', re.S)
_LITERAL = re.compile(r"Expected a typing\.Literal\[(.*)\]\. Got value: (.*)", re.S)


def one_line(message: str) -> str:
    """jsonargparse's (possibly multi-line) parse error as one line naming the flag."""
    from vae_ddp.harness.configs import flag

    m = _KEY.search(message)
    if m:
        name, rest = m.group(1), message[m.end():]
        lit = _LITERAL.search(rest)
        if lit:
            choices = ast.literal_eval(f"({lit.group(1)},)")
            return f"unknown {flag(name)} {lit.group(2).strip()!r}: use one of {', '.join(map(str, choices))}"
        rest = re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", rest)
        rest = re.sub(r"Expected a (\w+)\. Got value: (.*)", r"expected \1, got '\2'", rest, flags=re.S)
        rest = re.sub(r"Not of type (\w+): (.*?) does not conform to restriction v>0", r"\2 is not a positive integer",
                      rest)
        message = f"{flag(name)}: {rest}"
    message = message.replace('expected "command" to be one of', "expected a subcommand, one of")
    return " ".join(message.split())


def _check_out(out: Path) -> None:
    """``--out`` must be a folder we can create and write into: checked before any training by
    creating it and a scratch file, then removing what the check created."""
    import tempfile

    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a folder: choose a folder path")
    created, p = [], out
    while not p.exists():
        created.append(p)
        p = p.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(dir=out, prefix=".write-check-")
        os.close(fd)
        os.unlink(scratch)
    except OSError as err:
        raise UserError(f"--out {out} is not writable ({err.strerror or err}): choose a folder you can write to") from None
    finally:
        for d in created:  # deepest first
            try:
                d.rmdir()
            except OSError:
                pass


def _call(cmd: Command, ns: argparse.Namespace) -> Any:
    from vae_ddp.harness.configs import RunSpec

    args = {k: v for k, v in vars(ns).items() if k not in ("config", "__path__") and not k.startswith("__")}
    sig = inspect.signature(cmd.function)
    kwargs = {}
    if "base" in sig.parameters:
        spec_fields = {f.name for f in dataclasses.fields(RunSpec)}
        spec_kw = {k: args.pop(k) for k in list(args) if k in spec_fields}
        if "seed" in args:
            spec_kw["seeds"] = [args.pop("seed")]
        exact = args.get("exact") if "exact" in sig.parameters else args.pop("exact", False)
        base = RunSpec(**spec_kw)
        if exact and "exact" not in sig.parameters:
            base = base.exact()
        _preflight(base)
        kwargs["base"] = base
    if "out_dir" in args:
        _check_out(args["out_dir"])
    kwargs.update({k: v for k, v in args.items() if k in sig.parameters})
    return cmd.function(**kwargs)


def _preflight(base) -> None:
    """Everything about the input that can be checked before training: the spec's values,
    and the data (every image decodes; CIFAR-10 is there or can be downloaded)."""
    base.validate()
    from vae_ddp.data import check_data

    check_data(base.data, base.data_dir)


def main(argv: Optional[list[str]] = None) -> int:
    """Run ``vae-ddp ARGV`` (default: ``sys.argv[1:]``) and return its exit code.

    Bad input is one line on stderr and exit code 2, before any training: a
    [`UserError`][vae_ddp.errors.UserError], or a ``ValueError``/``OSError`` of the library's
    checks ([`input_error`][vae_ddp.errors.input_error]), whose field names are given as flags
    ([`in_flags`][vae_ddp.harness.configs.in_flags]: ``data_dir`` -> ``--data-dir``). A failed
    run is its error and exit code 1; Ctrl-C is exit code 130.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["audit"]:  # its own parser: the user's class paths and their init args
        from vae_ddp.audit.cli import main as audit_main

        return audit_main(argv[1:])
    from vae_ddp.harness.launch import RunFailed

    try:
        parser = build_parser()
        cfg = parser.parse_args(argv)
        name = cfg.command
        cmd = commands()[name]
        _call(cmd, cfg[name])
    except argparse.ArgumentError as err:
        print(f"vae-ddp: error: {one_line(str(err))}", file=sys.stderr)
        return 2
    except RunFailed as err:
        print(f"vae-ddp: error: {err}", file=sys.stderr)
        return 1
    except (UserError, ValueError, OSError) as err:
        bad = input_error(err)  # a UserError, or the library's plain exception naming a field (data_dir)
        if bad is not None:
            from vae_ddp.harness.configs import in_flags

            message = str(bad) if isinstance(bad, UserError) else in_flags(str(bad))
            print(f"vae-ddp: error: {' '.join(message.split())}", file=sys.stderr)
            return 2
        if isinstance(err, OSError):  # e.g. an --out folder that cannot be created
            print(f"vae-ddp: error: {err.strerror or err}: {err.filename or ''} (check --out and --data-dir)",
                  file=sys.stderr)
            return 2
        raise
    except SystemExit as err:  # --help, --print_config
        return err.code if isinstance(err.code, int) else 0
    except KeyboardInterrupt:
        print("vae-ddp: interrupted", file=sys.stderr)
        return 130
    return 0


def main_captured(argv: list[str], cwd: Optional[Path] = None) -> tuple[int, str, str]:
    """``vae-ddp ARGV`` in this process, from ``cwd`` (restored after): exit code, stdout, stderr.
    For callers that have torch and Lightning imported already (tests, the audit gallery): one
    interpreter start less than a subprocess; the runs it launches are processes either way."""
    import contextlib
    import io

    stdout, stderr, before = io.StringIO(), io.StringIO(), os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(argv)
    finally:
        os.chdir(before)
    return code, stdout.getvalue(), stderr.getvalue()


if __name__ == "__main__":
    sys.exit(main())
