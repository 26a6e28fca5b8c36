"""``vae-ddp``: jsonargparse over the study functions (``vae_ddp.studies.COMMANDS``), whose signatures
and docstrings make the flags, flat: [`RunSpec`][vae_ddp.harness.configs.RunSpec]'s fields (``base``) and the
study's parameters (``--global_batch_size 64``, ``--sync_bn true``, ``--configs '[single, ddp]'``, ``--out``)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import inspect
import io
import os
import re
import sys
from pathlib import Path
from typing import Optional

from vae_ddp.errors import Terminated

__all__ = ["build_parser", "main", "main_captured"]


def build_parser(spec_cls: Optional[type] = None, flags: bool = True):
    """The ``vae-ddp`` parser; ``spec_cls``: RunSpec (default) or a subclass with more fields;
    ``flags=False``: without the subcommands' flags (``vae-ddp -h``: no study or torch imported)."""
    from jsonargparse import ArgumentParser

    from vae_ddp.studies import COMMANDS

    parser = ArgumentParser(prog="vae-ddp", exit_on_error=False, usage=f"vae-ddp {{audit,{','.join(COMMANDS)}}} ...",
                            description="Why DDP on N devices with per-device "
                            "batch B/N does not reproduce one device with batch B, measured on the bolts CIFAR-10 VAE",
                            epilog="vae-ddp audit --model MODEL --data DATA ...: audit your own LightningModule")
    sub = parser.add_subcommands(dest="command")
    for name, (_, text, defaults, hide) in COMMANDS.items():
        p = ArgumentParser(prog=f"vae-ddp {name}", exit_on_error=False, description=text)
        sub.add_subcommand(name, _flags(p, name, defaults, hide, spec_cls) if flags else p, help=text)
    return parser


def _flags(p, name: str, defaults: dict, hide: tuple, spec_cls: Optional[type]):
    from jsonargparse.typing import NotEmptyStr

    from vae_ddp.errors import config_action
    from vae_ddp.fixes import registry
    from vae_ddp.studies import INTERNAL, study_function
    from vae_ddp.harness.configs import RunSpec

    function = study_function(name)
    p.add_argument("--config", action=config_action(), help="read the options from this YAML file (see --print_config)")
    params = inspect.signature(function).parameters
    if "base" in params:
        skip = INTERNAL | set(hide) | ({f.field for f in registry.switches()} if "switches" in hide else set())
        p.add_class_arguments(spec_cls or RunSpec, nested_key=None, skip=skip, as_group=False)
        if "seed" not in hide:
            p.add_argument("--seed", type=int, default=0, help="the run's seed (seed_everything)")
        if "exact" not in params and "switches" not in hide:
            p.add_argument("--exact", type=bool, default=False,
                           help="turn every fix on, over the fix switches (RunSpec.exact())")
    p.add_function_arguments(function, nested_key=None, skip={"base", "out_dir"}, as_group=False)
    p.add_argument("--out", type=NotEmptyStr, default=f"runs/{name}", help="output folder")
    p.set_defaults(**defaults)
    for action in p._actions:  # help as plain text (no cross-references); a flag with a default is optional
        action.help = action.help and re.sub(r"\[`([^`]+)`\]\[[^\]]+\]", r"\1", action.help).replace("``", "")
        action.required = action.required and action.dest not in defaults
    return p


@contextlib.contextmanager
def _sigterm_says_terminated():
    """While ``vae-ddp`` runs in the main thread, SIGTERM raises [`Terminated`][vae_ddp.errors.Terminated]
    (Python's default would end the process without a word); the previous handler is restored."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Optional[list[str]] = None) -> int:
    """``vae-ddp ARGV`` (default ``sys.argv[1:]``); returns the exit code: 1 a run failed, 3 the output
    folder's file system filled up after training started (one line naming it), 2 bad
    input (one line: a jsonargparse error, or [`input_error`][vae_ddp.errors.input_error]), 130 Ctrl-C,
    143 SIGTERM (``vae-ddp: terminated`` on stderr; every rank and worker it started ended). Ctrl-C
    while it imports is 130 too (this module imports only the standard library at its top), SIGTERM 143
    (the command's ``entry`` takes it at its first line). The run
    has a ``TMPDIR`` of its own ([`private_tmpdir`][vae_ddp.utils.private_tmpdir])."""
    audit = (sys.argv[1:] if argv is None else list(argv))[:1] == ["audit"]
    try:
        from vae_ddp.utils import private_tmpdir

        with _sigterm_says_terminated(), private_tmpdir(tuple(_MADE)):  # nothing left in TMPDIR, however it ends
            return _main(argv)
    except Terminated:
        print("vae-ddp: terminated", file=sys.stderr, flush=True)
        return 143
    except KeyboardInterrupt:
        print("vae-ddp audit: interrupted; no verdict" if audit else "vae-ddp: interrupted", file=sys.stderr)
        return 130


def _main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["audit"]:  # its own parser: the user's class paths and their init args
        from vae_ddp.audit.cli import main as audit_main

        return audit_main(argv[1:])
    if argv in (["-h"], ["--help"]):  # the subcommands only: seconds faster without torch and the studies
        return build_parser(flags=False).print_help() or 0
    from vae_ddp.errors import UserError, input_error, one_line
    from vae_ddp.guard import default_stall
    from vae_ddp.harness.configs import in_flags
    from vae_ddp.harness.launch import RunFailed
    from vae_ddp.studies import run_study

    try:
        default_stall()  # VAE_DDP_WATCHDOG_S: refused here, not in the runs
        cfg = build_parser().parse_args(argv)
        run_study(cfg.command, cfg[cfg.command].as_dict())
    except (argparse.ArgumentError, UserError, ValueError, OSError) as err:
        bad = err if isinstance(err, argparse.ArgumentError) else input_error(err)
        if bad is None and not isinstance(err, OSError):
            raise
        text = in_flags(str(bad)) if bad is not None else f"{err.strerror or err}: {err.filename or ''} (check --out)"
        print(f"vae-ddp: error: {one_line(text)}", file=sys.stderr)
        return 2
    except RunFailed as err:
        print(f"vae-ddp: error: {err}", file=sys.stderr)
        return 3 if getattr(err, "errno", None) == errno.ENOSPC else 1
    except SystemExit as err:  # --help, --print_config
        return err.code if isinstance(err.code, int) else 0
    except KeyboardInterrupt:
        print("vae-ddp: interrupted", file=sys.stderr)
        return 130
    return 0


def main_captured(argv: list[str], cwd: Optional[Path] = None) -> tuple[int, str, str]:
    """``vae-ddp ARGV`` in this process, from ``cwd``: exit code, stdout, stderr (one interpreter less)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd or "."), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _import_or_end_at_ctrl_c(argv: list[str]) -> None:
    """Import jsonargparse, torch and Lightning (most of the command's first seconds) with Ctrl-C ending
    the process at once: one line, exit code 130. A KeyboardInterrupt raised inside these imports can be
    lost in them and leave a module half-initialised: numpy's, whose ``__getattr__`` then recursed
    until a RecursionError with a traceback and exit code 1 (2 runs of 25, Ctrl-C 0.9-1.0 s after the
    start, measured). Nothing needs cleaning but the run folder, which its reaper removes.
    A SIGINT ignored by whoever started the command stays ignored; a ``-h`` or ``--help`` imports none of them
    (``vae-ddp audit -h`` answers without torch), nor does an audit whose arguments alone are refused
    ([`refusal`][vae_ddp.audit.argv.refusal]: it answers in well under a second)."""
    import signal

    if {"-h", "--help"} & set(argv) or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return
    if argv[:1] == ["audit"]:
        from vae_ddp.audit.argv import refusal

        if refusal(argv[1:], os.getcwd()):
            return

    def interrupted(signum, frame):
        print("vae-ddp audit: interrupted; no verdict" if argv[:1] == ["audit"] else "vae-ddp: interrupted",
              file=sys.stderr, flush=True)
        _tidy()
        os._exit(130)

    signal.signal(signal.SIGINT, interrupted)
    try:
        import jsonargparse  # noqa: F401
        import pytorch_lightning  # noqa: F401
        import torch  # noqa: F401
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _end_at_sigterm() -> None:
    """SIGTERM before [`main`][vae_ddp.cli.main] takes it over (while the command imports jsonargparse, torch and
    Lightning) and after main returned: one line, ``vae-ddp: terminated``, and exit code 143, as SIGTERM
    during a run ends (Python's default ended with -15 and nothing on stderr). Nothing needs cleaning then
    but the empty folder the imports may have made (``_tidy``): no other folder, no process exists before
    main's handler or after main returned."""
    import signal

    def terminated(signum, frame):
        print("vae-ddp: terminated", file=sys.stderr, flush=True)
        _tidy()
        os._exit(143)

    signal.signal(signal.SIGTERM, terminated)


#: Folders the command's imports create that it removes at its end if they are empty (``entry``).
_MADE: list[str] = []


def _tidy() -> None:
    """Remove the folders of ``_MADE`` that are empty: TMPDIR as the command found it."""
    from vae_ddp.utils import remove_if_empty

    for path in _MADE:
        remove_if_empty(path)


def _leave(code: int) -> None:
    """End the command with ``code`` once the output is flushed. ``os._exit`` after a Ctrl-C (130: see
    ``entry``) and when a thread that is not a daemon is still running (one the user's model
    or data started: the interpreter would wait for it at exit, and the command with it, after the report was
    written); otherwise ``sys.exit``. Raises ``SystemExit`` (that is how it ends)."""
    import threading

    _tidy()
    sys.stdout.flush()
    sys.stderr.flush()
    waiting = [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
    if code == 130 or waiting:
        os._exit(code)
    sys.exit(code)


def entry() -> None:
    """The ``vae-ddp`` command: ``main``'s exit code. Its first line takes SIGTERM (143 from the start,
    ``_end_at_sigterm``). It ends through ``os._exit``, once the output is flushed
    and ``main`` has cleaned up, after a Ctrl-C (130: a KeyboardInterrupt that went
    through a C-level run of Python code while torch or Lightning imported leaves CPython marked to end
    by re-raising SIGINT at exit; exit status -2 in about 4 runs of 10 with Ctrl-C 1 to 3 s after the start,
    measured, although ``main`` caught it and returned 130) and when the user's code left a thread running
    (``_leave``: the command only borrows the model and the data; the Python API and the
    pytest helper leave the caller's threads alone). The imports run in the command's own ``TMPDIR``
    ([`private_tmpdir`][vae_ddp.utils.private_tmpdir]), so the cache folder of torch inductor they make goes
    with it, also after a SIGKILL during them. Raises ``SystemExit`` (that is how it ends)."""
    _end_at_sigterm()
    from vae_ddp.utils import inductor_folder_to_remove, private_tmpdir

    # the imports inside the run folder (main's, shared), so that inductor's folder they make is made in it and a
    # SIGKILL during them leaves nothing (the folder's reaper): made in TMPDIR before, it stayed there
    try:
        with private_tmpdir():
            try:
                _MADE[:] = filter(None, [inductor_folder_to_remove()])  # (None but where the folder cannot be made)
                _import_or_end_at_ctrl_c(sys.argv[1:])
                code = main()
            finally:  # its zygote, still importing (a SIGTERM at once), made inductor's folder in the removed one
                if "vae_ddp.zygote" in sys.modules:  # (main's callers in one process, the tests, keep theirs)
                    sys.modules["vae_ddp.zygote"].end_all()
    except KeyboardInterrupt:  # a Ctrl-C while the run folder is made, before the imports take it: 130, not -2
        print("vae-ddp audit: interrupted; no verdict" if sys.argv[1:2] == ["audit"] else "vae-ddp: interrupted",
              file=sys.stderr, flush=True)
        code = 130
    _leave(code)


if __name__ == "__main__":
    entry()
