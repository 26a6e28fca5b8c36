"""What the audit's arguments alone tell, answered before anything heavy is imported.

[`refusal`][vae_ddp.audit.argv.refusal] reads ``vae-ddp audit``'s command line as strings: a flag the
audit does not take (an abbreviated one included: ``--step`` is not ``--steps``), a flag without its
value, ``--model``/``--data`` missing, a class path that names neither an existing ``path/to/file.py:Class``
nor an importable-looking ``package.module.Class``. Each is one line, said before jsonargparse parses,
and so before torch, Lightning or the user's file is imported (they take seconds). Misspelled names get
a "did you mean" ([`did_you_mean`][vae_ddp.audit.argv.did_you_mean], ``difflib``), the flags here and
the keywords of the Python API ([`unexpected_keywords`][vae_ddp.audit.argv.unexpected_keywords]).

This module imports only the standard library at its top.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import os
from importlib.machinery import PathFinder
from typing import Callable, Iterable, Optional

__all__ = ["FLAGS", "refusal", "class_path_problem", "did_you_mean", "keywords", "unexpected_keywords"]

#: Every flag of the audit's parser (``vae_ddp.audit.cli.build_parser``; a test keeps them equal).
FLAGS = ("--accelerator", "--config", "--data", "--data.help", "--devices", "--dtype", "--effect_batches", "--help",
         "--model", "--model.help", "--out", "--print_config", "--seed", "--seed_everything", "--steps", "--trainer",
         "-h")
#: The flags that take no value.
SWITCHES = ("-h", "--help", "--print_config")
#: The flags whose dotted names (``--model.init_args.NAME``, ``--trainer.NAME``) the parser checks.
NESTED = ("--data", "--model", "--trainer")
#: The required flags, and what each is.
REQUIRED = {"--model": "your LightningModule", "--data": "your LightningDataModule"}
#: The flags whose value is a class path.
CLASS_FLAGS = ("--model", "--data", "--model.help", "--data.help")
#: What a class path is.
GIVE = "give path/to/file.py:Class or package.module.Class"


def did_you_mean(word: str, choices: Iterable[str]) -> Optional[str]:
    """The one of ``choices`` that ``word`` most likely misspells: the only one it begins (an
    abbreviation), else the closest by ``difflib.get_close_matches``; None if none is close."""
    choices = [c for c in choices if c != word]
    longer = [c for c in choices if c.startswith(word)]
    if len(longer) == 1:
        return longer[0]
    close = difflib.get_close_matches(word, choices, n=1)
    return close[0] if close else None


def refusal(argv: list[str], cwd: str) -> Optional[str]:
    """The line that refuses ``vae-ddp audit ARGV`` from its strings alone (``cwd``: where class paths
    and files are looked for), or None when the parser has to tell. ``-h``/``--help`` is never refused;
    a ``--config`` file, ``--print_config``, ``--model.help``/``--data.help`` and jsonargparse's
    ``JSONARGPARSE_DEFAULT_ENV=true`` (flags from the environment) may go without ``--model`` and ``--data``.
    Looks up files and top-level module names only: imports nothing of the user's."""
    args = argv[:argv.index("--")] if "--" in argv else list(argv)
    if {"-h", "--help"} & set(args):
        return None
    given, unknown = {}, []
    i = 0
    while i < len(args):
        token, i = args[i], i + 1
        if not token.startswith("--"):
            continue  # a value (read with its flag) or a stray word: the parser's
        flag, eq, value = token.partition("=")
        if flag not in FLAGS and not (flag.split(".")[0] in NESTED and "." in flag):
            tail = list(args[i:])
            end = next((j for j, t in enumerate(tail) if t.startswith("-")), len(tail))
            unknown.append((flag, [token, *tail[:end]]))
            continue
        if not eq and flag not in SWITCHES:
            if i == len(args) or args[i].startswith("--"):
                return f"{flag}: expected a value (see -h)"
            value, i = args[i], i + 1
        given[flag] = value
    if unknown:
        return _unknown(unknown)
    missing = [f for f in REQUIRED if f not in given]
    from_env = os.environ.get("JSONARGPARSE_DEFAULT_ENV", "").lower() == "true"  # jsonargparse reads them there
    if missing and not from_env and not {"--config", "--print_config", "--model.help", "--data.help"} & set(given):
        what = [f"{REQUIRED[f]} as {f}" for f in missing]
        what[0] += " package.module.Class or path/to/file.py:Class"
        return (f"the following arguments are required: {', '.join(sorted(missing))}: give {', and '.join(what)} "
                "(see -h)")
    return next(filter(None, (class_path_problem(f, given[f], cwd) for f in CLASS_FLAGS if f in given)), None)


def _unknown(unknown: list[tuple[str, list[str]]]) -> str:
    """``unrecognized arguments: ...`` as the parser says it ([`one_line`][vae_ddp.errors.one_line]: a dashed
    spelling answered with the underscores), with the flags each most likely misspells."""
    from vae_ddp.errors import one_line

    text = one_line("unrecognized arguments: " + " ".join(t for _, tokens in unknown for t in tokens))
    guesses = []
    for flag, _ in unknown:
        head, dot, rest = flag.partition(".")
        if "-" in flag[2:]:
            continue  # --effect-batches, --data-dir: another command line's spelling, answered with the underscores
        guess = did_you_mean(head, (f for f in FLAGS if f not in SWITCHES) if dot else FLAGS)
        if guess:
            guesses.append((flag, guess + dot + rest, guess.startswith(head)))
    if not guesses:
        return text if "(" in text else f"{text} (see -h for the flags)"
    if len(guesses) == 1:
        flag, guess, abbreviated = guesses[0]
        return f"{text} (did you mean {guess}?{' flags are not abbreviated' if abbreviated else ''})"
    return f"{text} (did you mean {', '.join(f'{guess} for {flag}' for flag, guess, _ in guesses)}?)"


def class_path_problem(flag: str, value: str, cwd: Optional[str] = None) -> Optional[str]:
    """Why ``FLAG VALUE`` names no class the audit can import, from the string and the file system alone,
    or None: ``value`` is no ``path/to/file.py:Class`` whose file exists nor a dotted ``package.module.Class``
    (with ``cwd``: whose first name a module of ``cwd`` or ``sys.path`` has). A config (``{...}``, a
    ``.yaml``/``.json`` file) is the parser's to read (None)."""
    if value.startswith(("{", "-")) or value.endswith((".yaml", ".yml", ".json")):
        return None
    if ":" in value:
        file, _, name = value.rpartition(":")
        path = os.path.join(cwd or "", file)
        if not file.endswith(".py"):
            there = f" ({file}.py exists: {flag} {file}.py:{name})" if os.path.isfile(path + ".py") else ""
            return f"{flag} {value} names no file.py: {GIVE}{there}"
        if not os.path.isfile(path):
            return f"{flag}: {file} does not exist: {GIVE}"
        return None if name.isidentifier() else f"{flag} {value}: {name!r} is not a class name: {GIVE}"
    if value.endswith(".py"):
        return f"{flag} {value} names no class: give {value}:Class"
    parts = value.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        return f"{flag} {value} is not a class path: {GIVE}"
    if cwd is None or _findable(parts[0], cwd):
        return None
    near = did_you_mean(parts[0], _modules_in(cwd))
    return (f"{flag} {value} does not import (ModuleNotFoundError: No module named {parts[0]!r}): give "
            "package.module.Class or path/to/file.py:Class" + (f" (did you mean {near}?)" if near else ""))


def _findable(name: str, cwd: str) -> bool:
    """A top-level module ``name`` is in ``cwd`` or found by this process's finders (not imported)."""
    try:
        return PathFinder.find_spec(name, [cwd]) is not None or importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a module of sys.modules without a spec: there
        return True


def _modules_in(folder: str) -> list[str]:
    """The names of ``folder``'s entries that can be a top-level module (a folder, ``name.py``)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [n.removesuffix(".py") for n in names if n.removesuffix(".py").isidentifier()]


def keywords(*functions: Callable) -> list[str]:
    """The keyword-only arguments of ``functions``, in order."""
    return list(dict.fromkeys(n for f in functions for n, p in inspect.signature(f).parameters.items()
                              if p.kind is p.KEYWORD_ONLY))


def unexpected_keywords(function: str, given: Iterable[str], own: Iterable[str]) -> None:
    """Refuse a keyword of ``given`` (the ``**`` keywords a call of ``function`` got) that is neither one of
    ``own`` (its keyword arguments, [`keywords`][vae_ddp.audit.argv.keywords]) nor an argument of Lightning's
    ``Trainer``, naming the likeliest of those it misspells (``step`` -> ``steps``, ``data_arg`` -> ``data_args``,
    ``gradient_clip_vale`` -> ``gradient_clip_val``).

    Raises:
        TypeError: ``function() got an unexpected keyword argument 'NAME' (did you mean 'OTHER'?) ...``,
            as Python says it for a function without ``**``.
    """
    from pytorch_lightning import Trainer

    own, trainer = list(own), list(inspect.signature(Trainer).parameters)
    for key in given:
        if key not in own and key not in trainer:
            near = did_you_mean(key, own + trainer)
            raise TypeError(f"{function}() got an unexpected keyword argument {key!r}"
                            + (f" (did you mean {near!r}?)" if near else "")
                            + f": it takes {', '.join(own)} and the arguments of Lightning's Trainer")
