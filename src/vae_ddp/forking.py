"""Python in a fork of this process: the project's one call of ``os.fork`` and what a fork needs.

[`fork`][vae_ddp.forking.fork] runs a function in a child that leaves with the exit code the
interpreter would give it ([`call_as_main`][vae_ddp.forking.call_as_main]; [`wait`][vae_ddp.forking.wait]
reads it), only where
[`can_fork`][vae_ddp.forking.can_fork] holds; [`run_as_python`][vae_ddp.forking.run_as_python]
runs ``python ARGV`` in such a child as a new interpreter would. The guard
([`vae_ddp.guard`][vae_ddp.guard]), the ranks ([`vae_ddp.ranks`][vae_ddp.ranks]), the zygotes
([`vae_ddp.zygote`][vae_ddp.zygote]) and the launch's groups fork through it; ``tests/test_guard.py``
checks there is no other call of ``os.fork``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any, Callable, Iterable, Iterator, Optional

__all__ = ["fork", "wait", "can_fork", "call_as_main", "run_as_python", "prctl", "spawned_map"]


def can_fork() -> bool:
    """Whether this process may fork a child that goes on computing: Linux, and one thread runs
    (a process forked from one that computed with several intra-op threads hangs in its first
    parallel region, GNU OpenMP's pool not surviving ``fork``, measured with torch 2.14; and a lock
    another thread held at the fork stays held)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def call_as_main(main: Callable[[], Optional[int]]) -> int:
    """``main()``'s exit code as the interpreter would give it, stdout and stderr flushed: its
    return value (None: 0); ``SystemExit``'s code (a message printed, then 1); 1 with the
    traceback printed for any other exception."""
    code = 1
    try:
        returned = main()
        code = returned if isinstance(returned, int) else 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed stream: nothing more to say
                stream.flush()
    return code


def fork(main: Callable[[], Optional[int]], parent_death: Optional[int] = None) -> int:
    """The one ``fork`` of this project: run ``main()`` in a child process; return its pid here.

    The child leaves with ``os._exit`` and [`call_as_main`][vae_ddp.forking.call_as_main]'s code
    (none of this process's exit handlers run twice). ``parent_death``: the signal the child gets
    when this process dies, even by SIGKILL (Linux ``prctl(PR_SET_PDEATHSIG)``). Buffered output
    is flushed first. Only where [`can_fork`][vae_ddp.forking.can_fork] holds."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        if parent_death is not None:
            prctl(1, parent_death)  # PR_SET_PDEATHSIG
        code = call_as_main(main)
    finally:
        os._exit(code)


def wait(pid: int) -> int:
    """The exit code of this process's child ``pid`` once it ended (blocks until then): its
    ``sys.exit`` code, or minus the signal that ended it (``os.waitstatus_to_exitcode``)."""
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def prctl(option: int, value: int) -> None:
    """Linux ``prctl(option, value)`` (``PR_SET_PDEATHSIG``: 1, ``PR_SET_CHILD_SUBREAPER``: 36); nothing
    elsewhere (the guard's polling covers it)."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(option, int(value), 0, 0, 0)


def set_name(name: str) -> None:
    """Name this process where ``ps -eo comm`` and ``top`` show it (Linux ``prctl(PR_SET_NAME)``: 15 bytes at
    most, the rest cut): ``vae-ddp guard``, ``vae-ddp rank 1``, ... (a fork keeps its parent's command line,
    which tells no process of a launch from another). Nothing elsewhere."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def _dies_with_parent() -> None:
    prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: a worker does not outlive the process that started it


def spawned_map(fn: Callable[..., Any], calls: Iterable[tuple], jobs: int) -> Iterator[Any]:
    """``fn(*args)`` for each ``args`` of ``calls``, ``jobs`` at a time in new interpreters
    (``multiprocessing``'s ``spawn``: nothing of this process's threads or imports is inherited,
    so a caller that computed with torch's thread pools may use it); the results in the order of
    ``calls``, each as soon as it and those before it are done. A worker gets SIGKILL when this
    process dies, even by SIGKILL (``PR_SET_PDEATHSIG``); on an exception here the pool is shut
    down. ``fn`` must be importable by name (a module-level function)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"), initializer=_dies_with_parent) as pool:
        futures = [pool.submit(fn, *args) for args in calls]
        try:
            for future in futures:
                yield future.result()
        finally:
            for future in futures:
                future.cancel()


def run_as_python(argv: list[str], env: dict) -> int:
    """``python ARGV`` in this process (a fork that already imported what it needs) as a fresh
    interpreter would run it: ``argv`` is ``["-m", MODULE, *args]`` or ``[SCRIPT, *args]``, run as
    ``__main__`` (``runpy``) with that command's ``sys.argv`` and ``sys.path[0]``, ``os.environ =
    env``, the guard's signal handlers undone, stdout unbuffered, torch's intra-op threads from
    ``$OMP_NUM_THREADS`` (which a new interpreter's torch reads at import). Returns 0."""
    import runpy

    set_name("vae-ddp run")  # not its guard's name: a launch's ranks name themselves (beats), a docs entry keeps it
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(env)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(write_through=True)
    module = argv[1] if argv[0] == "-m" else None
    sys.argv = list(argv[1:] if module else argv)
    sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0]))
    # a new interpreter's PYTHONPATH entries follow sys.path[0] (the caller's, when it set another than the fork's)
    sys.path[1:1] = [d for d in env.get("PYTHONPATH", "").split(os.pathsep) if d and d not in sys.path]
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if "torch" in sys.modules and threads.isdigit() and int(threads) > 0:
        sys.modules["torch"].set_num_threads(int(threads))
    if module:
        if not hasattr(sys.modules.get(module), "__path__"):  # (a package runs its __main__, never imported)
            sys.modules.pop(module, None)  # imported by a zygote: run afresh as __main__, as a new interpreter runs it
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(argv[0], run_name="__main__")
    return 0
