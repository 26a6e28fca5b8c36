"""User-facing errors: one line saying what is wrong and what to do, no traceback.

The study application raises [`UserError`][vae_ddp.errors.UserError] in the words of the
``vae-ddp`` command (its flags). The library ([`vae_ddp.data`][vae_ddp.data]) raises plain
``ValueError``, ``FileNotFoundError`` and ``NotADirectoryError`` that name the Python
argument (``data_dir``); a command line finds them with
[`input_error`][vae_ddp.errors.input_error] and prints them with its own flag spelling.
"""

from __future__ import annotations

import ast
import functools
import re
from typing import Optional

__all__ = ["UserError", "RunFailed", "Terminated", "input_error", "one_line", "config_action"]

#: the modules whose ValueError and OSError mean bad input (their docstrings say which)
INPUT_MODULES = ("vae_ddp.data", "vae_ddp.utils")


class UserError(Exception):
    """Bad input detected before any training starts. ``str(err)`` is the whole message."""


class Terminated(BaseException):
    """SIGTERM reached ``vae-ddp``: raised in the main thread so that every guard ends its tree
    (``vae_ddp.cli``)."""


class RunFailed(RuntimeError):
    """A training run exited non-zero; ``str()`` holds its label, exit code and stderr tail
    (raised by [`launch`][vae_ddp.harness.launch.launch])."""


def input_error(err: BaseException) -> Optional[BaseException]:
    """The bad input behind ``err``, or None when ``err`` is something else (a bug, a failed run).

    Bad input is a [`UserError`][vae_ddp.errors.UserError], or a ``ValueError`` or ``OSError``
    raised by the library's own checks (a module of ``INPUT_MODULES``: a missing or empty
    ``data_dir``, an image that cannot be decoded, CIFAR-10 that cannot be had), not one raised
    further down (torch, the file system). ``err`` itself or any exception in its
    ``__cause__``/``__context__`` chain counts (jsonargparse wraps what a data module raises).
    """
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, UserError):
            return err
        if isinstance(err, (ValueError, OSError)):
            tb = err.__traceback__
            while tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
            if tb is not None and tb.tb_frame.f_globals.get("__name__") in INPUT_MODULES:
                return err
        err = err.__cause__ or err.__context__
    return None


@functools.cache
def config_action() -> type:
    """jsonargparse's ``--config`` action (``ActionConfigFile``) whose errors start with the file
    they are about (``argument --config: FILE: ...``), for [`one_line`][vae_ddp.errors.one_line]
    to name it; both command lines' ``--config``."""
    import argparse

    from jsonargparse import ActionConfigFile

    class ConfigFile(ActionConfigFile):
        def __call__(self, parser, cfg, values, option_string=None):
            try:
                super().__call__(parser, cfg, values, option_string)
            except (argparse.ArgumentError, TypeError, ValueError) as err:
                raise argparse.ArgumentError(self, f"{values}: {err}") from None

    return ConfigFile


#: a flag spelled with dashes inside its name (``--data-dir``, ``--data.init-args.batch-size``)
_DASHED = r"--[\w.]*\w-[\w.-]*"


def _config(flat: str) -> Optional[str]:
    """A ``--config FILE`` error (``config_action``) as one line naming the file: YAML that does
    not parse with its line and column, else the error of the option the file sets."""
    m = re.match(r"argument --config: (.*?): (?:Problems parsing config: )?(.*)$", flat)
    if not m:
        return None
    file, inner = m.groups()
    yaml = re.search(r'^(?:Parser key "config": )?(.*?) in "<unicode string>", line (\d+), column (\d+)', inner)
    if yaml:
        what, line, column = yaml.groups()
        return (f"--config {file} is not valid YAML (line {line}, column {column}: {what}): fix that line, or start "
                "from the file --print_config writes")
    inner = one_line(inner)
    return inner if inner.startswith("--config:") else f"--config {file}: {inner}"


def one_line(text: str) -> str:
    """An error message as one line; jsonargparse's (``Parser key "steps":`` and its reasons, over
    several lines) names the flag and what it expected (``--steps: expected int, got 'ten'``), and
    a value outside a ``Literal``'s choices says them (``unknown --model 'x': use one of resnet18, small``).
    An empty value of a flag typed ``jsonargparse.typing.NotEmptyStr`` (``--out ''``) says so.

    Dotted flags keep their names (``--trainer.gradient_clip_val``). A bad init argument of a
    class given by its path (``--model.init_args.hidden``) is named as such:
    ``--model.init_args.hidden: Net has no init argument 'hidden'``, or the argument's own error.

    A flag typed with dashes (``--data-dir``, ``--data.init-args.batch-size``) is answered with its
    spelling in underscores; a missing flag is named as it is typed (``--model``); an error in a
    ``--config`` file ([`config_action`][vae_ddp.errors.config_action]) names the file, and for YAML
    that does not parse, the line and column and what to do.
    """
    flat = " ".join(text.split())
    config = _config(flat)
    if config is not None:
        return config
    dashed = re.search(r'Parser key "([\w.]+)":.*NestedArg\(key=\'([\w.]*-[\w.-]*)\'', flat)
    if dashed:  # --data.init-args.batch-size: jsonargparse's keys are the Python names
        flag = f"{dashed[1]}.{dashed[2]}"
        return f"--{flag}: flags are the Python names, with underscores: --{flag.replace('-', '_')}"
    nested = re.match(r'Parser key "([\w.]+)": .*?Problem with given class_path \'([\w.]+)\': (.*?)'
                      r" - Expected a <class 'NoneType'>.*Given value: NestedArg\(key='([\w.]+)', val=(.*)\)$", flat)
    if nested:  # --model.init_args.X of a subclass argument (jsonargparse's add_subclass_arguments)
        key, cls, inner, arg, _ = nested.groups()
        flag = f"{key}.init_args.{arg}"
        if inner.endswith("is not accepted"):
            return f"--{flag}: {cls.rsplit('.', 1)[-1]} has no init argument {arg!r}"
        return one_line(re.sub(r'^Parser key "[\w.]+":', f'Parser key "{flag}":', inner))
    text = re.sub(r'Parser key "(?:--)?([\w.-]+)":', r"--\1:", flat)
    if empty := re.match(r"(--[\w.]+): Not of type NotEmptyStr", text):  # jsonargparse.typing.NotEmptyStr
        return f"{empty[1]} is empty: give it a value (see -h)"
    lit = re.search(r"(--[\w.]+):.*?Expected a typing\.Literal\[(.*?)\]\. Got value: (.*?)(?: - |$)", text)
    if lit:
        return f"unknown {lit[1]} {lit[3]!r}: use one of {', '.join(ast.literal_eval(f'({lit[2]},)'))}"
    typed = re.match(r"(--[\w.]+): (?:Does not validate against any of the Union subtypes.*Given value: "
                     r"|.*Got value: )(.*)$", text)
    if typed:  # a value that is not of the flag's type (of none of an Optional's types)
        kinds = re.findall(r"Expected a <class '(\w+)'>", text)
        text = f"{typed[1]}: expected {' or '.join(k.replace('NoneType', 'null') for k in kinds)}, got {typed[2]!r}"
    typed_flags = re.findall(_DASHED, text.partition("unrecognized arguments: ")[2])
    if typed_flags:  # the dashed spelling of another command line: the flags as this one spells them
        text += (f" (flags are the Python names, with underscores: "
                 f"{', '.join('--' + f[2:].replace('-', '_') for f in typed_flags)}; see -h)")
    required = re.match(r"(.*arguments are required: )(.*)$", text)
    if required:  # argparse names a missing flag by its key ("required: model"): named as it is typed
        text = required[1] + ", ".join(k if k.startswith("-") else f"--{k}" for k in required[2].split(", "))
    if re.search(r": expected (\w+ or )*list", text):
        text += " (write a list as '[a, b]', quoted for the shell)"
    return text.replace("expected one argument", "expected a value (true or false for a switch)")
