"""A zygote: a process that imported a launch's child module once and forks each launch of it.

A launch's child ([`launch`][vae_ddp.harness.launch.launch]) is ``python -m vae_ddp.harness
MODULE:FUNCTION JOB_FILE OUT_DIR``; most of a short run's time is that interpreter importing torch
and Lightning (5-9 s here). Where the caller may not fork it itself (a process that computed with
several threads: pytest, a notebook; an audit, whose process imported the user's modules), the
launch asks this module's zygote of ``MODULE``: ``python -m vae_ddp.guard --zygote MODULE ...``,
started once per caller process ([`warm`][vae_ddp.zygote.warm]: the audit starts it before its
own checks, so that the import runs beside them), imports ``MODULE`` and nothing of the caller,
and for each launch forks a guard ([`guard_forked`][vae_ddp.guard.guard_forked]) whose command is
a fork of it that runs the command as a new interpreter would
([`run_as_python`][vae_ddp.forking.run_as_python]): the same guard, watchdog and process tree as
a new interpreter under [`guard.run`][vae_ddp.guard.run], without the imports. The streams travel
as descriptors (``SCM_RIGHTS``), the environment and folder with the request; the launch's exit
code comes back.

The zygote ends within 0.1 s of its caller's death, even by SIGKILL and while it imports (it polls its parent:
``PR_SET_PDEATHSIG`` would fire when the caller's *thread* that started it ends, and it serves all
the caller's threads), and its guards with it (they end their trees); it ignores SIGINT (a
terminal's Ctrl-C is the caller's to handle). It never computes: its only threads are OpenBLAS's
idle pool, as in the ranks it forks ([`vae_ddp.ranks`][vae_ddp.ranks]). ``VAE_DDP_LAUNCH=exec``
turns zygotes off.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from typing import Any, Callable, Optional

from vae_ddp import forking
from vae_ddp.utils import run_lock

__all__ = ["warm", "start", "usable", "end_all"]

_ZYGOTES: dict[tuple[int, str, tuple], "_Zygote"] = {}
_LOCK = threading.Lock()
#: the seconds a zygote may take to import its module before the launch starts an interpreter instead
_READY_S = 600.0
#: the seconds a running zygote may take to fork a launch's guard and say its pid
_REPLY_S = 120.0


def usable(cmd: list[str], preload: tuple[str, ...] = ()) -> bool:
    """Whether ``cmd`` may run in a fork of a zygote: on Linux, ``$VAE_DDP_LAUNCH`` not ``exec``,
    ``[sys.executable, "-m", "vae_ddp...", ...]`` (this project's launch children, which import
    nothing of the caller at their top), or with ``preload`` (the modules the zygote imports) any
    ``[sys.executable, SCRIPT or "-m", MODULE, ...]``."""
    python = sys.platform.startswith("linux") and os.environ.get("VAE_DDP_LAUNCH") != "exec" and \
        cmd[:1] == [sys.executable] and len(cmd) > 1
    return python and (bool(preload) or cmd[1] == "-m" and len(cmd) > 2 and cmd[2].startswith("vae_ddp."))


def _module(cmd: list[str], preload: tuple[str, ...] = ()) -> str:
    """What a zygote imports for ``cmd`` (modules joined by commas): ``preload`` if given, else the
    ``-m`` module, or for a launch's child (``python -m vae_ddp.harness MODULE:FUNCTION ...``)
    ``MODULE``, what it trains with."""
    if preload:
        return ",".join(preload)
    return cmd[3].partition(":")[0] if cmd[2] == "vae_ddp.harness" and len(cmd) > 3 else cmd[2]


def warm(module: str, env: Optional[dict] = None) -> None:
    """Start this process's zygote of ``module`` (if none runs and [`usable`][vae_ddp.zygote.usable]
    holds for its command) without waiting for its imports; ``env``: entries the launches it serves add to this
    process's environment (those read at an interpreter's start, ``AT_START``, choose the zygote)."""
    if usable([sys.executable, "-m", module]):
        _zygote(module, wait=False, at_start=_at_start(dict(os.environ, **(env or {}))))


def end_all() -> None:
    """End this process's zygotes (SIGKILL, waited for; their guards end their trees), before a caller leaves a
    folder the zygotes' imports write into: a zygote still importing when its caller's run folder was removed
    made inductor's cache folder in it again. The next launch starts a new zygote."""
    with _LOCK:
        mine = [k for k in _ZYGOTES if k[0] == os.getpid()]
        zygotes = [_ZYGOTES.pop(k) for k in mine]
    for z in zygotes:
        z.sock.close()
        with contextlib.suppress(Exception):
            z.proc.kill()
            z.proc.wait(timeout=10)


def start(cmd: list[str], stall: Optional[float], grace: float, startup: Optional[float],
          env: Optional[dict] = None, stdout: Any = None, stderr: Any = None, cwd: Any = None,
          preload: tuple[str, ...] = ()) -> Optional["Launched"]:
    """``cmd`` ([`usable`][vae_ddp.zygote.usable]) under a guard forked by the zygote of its module
    (``preload``: of these modules instead), run in ``cwd`` (default: this process's) with ``env``:
    what [`guard.run_all`][vae_ddp.guard.run_all] waits for (``pid``, ``wait``, ``terminate``,
    ``kill``, ``returncode``, as a ``psutil.Process``). ``stdout``, ``stderr``: None (this process's),
    ``subprocess.DEVNULL``, a descriptor or a file. The zygote starts with ``env``'s entries of ``AT_START``
    (read only at an interpreter's start). None when no zygote could start or
    import the module (the caller then starts an interpreter, which reports the error)."""
    env = dict(os.environ if env is None else env)
    z = _zygote(_module(cmd, preload), wait=True, at_start=_at_start(env))
    if z is None:
        return None
    request = {"cmd": list(map(str, cmd)), "env": env, "cwd": os.path.abspath(cwd or os.getcwd()),
               "stall": stall, "grace": grace, "startup": startup}
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    null = os.open(os.devnull, os.O_RDWR)
    # the lock of the run folder the launch's TMPDIR is: the guard and its ranks hold it with this process, so
    # that the folder's reaper removes it only once they too have ended (a killed caller's ranks still write)
    lock = run_lock(env.get("TMPDIR"))
    try:
        fds = [theirs.fileno()] + [null if s == subprocess.DEVNULL else fd if s is None else
                                   s if isinstance(s, int) else s.fileno() for s, fd in ((stdout, 1), (stderr, 2))]
        fds += [lock] if lock is not None else []
        with z.lock:
            socket.send_fds(z.sock, [json.dumps(request).encode()], fds)
    except OSError:
        mine.close()
        return None
    finally:
        theirs.close()
        os.close(null)
    mine.settimeout(_REPLY_S)
    try:
        reply = mine.recv(4096)
    except TimeoutError:  # a zygote that does not answer (stopped?) is ended, and with it what it started
        z.proc.kill()
        reply = b""
    mine.settimeout(None)
    if not reply:  # the zygote died: the caller starts an interpreter
        mine.close()
        return None
    return Launched(json.loads(reply)["pid"], mine)


class Launched:
    """A guard forked by a zygote, waited for as ``psutil.wait_procs`` waits for a process: its exit
    code arrives from the zygote (its parent) on ``sock``."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid, self.sock = pid, sock
        self.returncode: Optional[int] = None
        self._code: Optional[int] = None

    def wait(self, timeout: Optional[float] = None) -> int:
        import psutil

        if self._code is None:
            self.sock.settimeout(timeout)
            try:
                reply = self.sock.recv(4096)
            except (TimeoutError, BlockingIOError):  # BlockingIOError: timeout 0
                raise psutil.TimeoutExpired(timeout, pid=self.pid) from None
            # no reply: the zygote died (its guards with it): as a process SIGKILL ended
            self._code = json.loads(reply)["code"] if reply else -signal.SIGKILL
            self.sock.close()
        return self._code

    def is_running(self) -> bool:
        return self._code is None

    def _signal(self, sig: int) -> None:
        if self._code is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)


class _Zygote:
    def __init__(self, module: str, at_start: tuple) -> None:
        import psutil

        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.lock = threading.Lock()
        self.ready: Optional[bool] = None
        with theirs:
            # the zygote's own streams: this process's stderr (an import's warning), no stdin
            self.proc = psutil.Popen([sys.executable, "-m", "vae_ddp.guard", "--zygote", module,
                                      str(theirs.fileno()), str(os.getpid())], pass_fds=[theirs.fileno()],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     env=_with(at_start))

    def wait_ready(self) -> bool:
        if self.ready is None:
            readable = select.select([self.sock], [], [], _READY_S)[0]
            self.ready = bool(readable) and self.sock.recv(16) == b"ready"
            if not self.ready:
                self.proc.kill()
        return self.ready


#: The environment variables an interpreter reads at its start only: a zygote's are those of the launches it serves
#: (``PYTHONHASHSEED``; ``VAE_DDP_LIGHTNING``, the Lightning package ``vae_ddp`` aliases at its import).
AT_START = ("PYTHONHASHSEED", "VAE_DDP_LIGHTNING")


def _at_start(env: dict) -> tuple:
    return tuple((k, env.get(k)) for k in AT_START)


def _with(at_start: tuple) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in AT_START}
    return dict(env, **{k: v for k, v in at_start if v is not None})


def _zygote(module: str, wait: bool, at_start: tuple = ()) -> Optional[_Zygote]:
    key = (os.getpid(), module, at_start)  # a fork of this process starts its own
    with _LOCK:
        z = _ZYGOTES.get(key)
        if z is None or z.proc.poll() is not None:
            try:
                z = _ZYGOTES[key] = _Zygote(module, at_start)
            except OSError:
                return None
    if wait:
        with z.lock:  # one reader of the zygote's "ready" (parallel audits of one process)
            if not z.wait_ready():
                return None
    return z


# --------------------------------------------------------------------------- the zygote's side
def serve(module: str, fd: int, caller: int, guard_forked: Callable[..., int]) -> int:
    """The zygote: import ``module`` (modules joined by commas), say ``ready`` on the socket ``fd``,
    then for each request fork a guard of its command (``guard_forked``:
    [`vae_ddp.guard.guard_forked`][vae_ddp.guard.guard_forked], given by the guard's entry point
    ``python -m vae_ddp.guard --zygote MODULE FD CALLER``, which runs this: this module imports no
    guard, whose [`run_all`][vae_ddp.guard.run_all] starts zygotes) and send back the guard's pid,
    later its exit code; end when ``caller`` (the parent) dies or closes the socket, also while it imports."""

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    forking.set_name("vae-ddp zygote")
    # no PR_SET_PDEATHSIG: Linux sends it when the *thread* that started this process ends, and a
    # caller's zygote serves the caller's other threads too (two docs entries at once: the second
    # entry was killed with the zygote when the first one's thread ended); the caller is polled instead
    if os.getppid() != caller:
        return 1
    sock = socket.socket(fileno=fd)
    _import_while_the_caller_lives(module.split(","), caller)
    with contextlib.suppress(OSError):
        sock.send(b"ready")
    waiting: dict[int, socket.socket] = {}
    while os.getppid() == caller:  # the caller died: its guards end their trees (their PR_SET_PDEATHSIG)
        with contextlib.suppress(ChildProcessError):
            while (ended := os.waitpid(-1, os.WNOHANG))[0]:
                reply = waiting.pop(ended[0], None)
                if reply is not None:
                    with contextlib.suppress(OSError), reply:
                        reply.send(json.dumps({"code": os.waitstatus_to_exitcode(ended[1])}).encode())
        if not select.select([sock], [], [], 0.1)[0]:
            continue
        message, fds, _, _ = socket.recv_fds(sock, 1 << 22, 4)
        if not message:  # the caller closed its end: it is going
            return 0
        request, (reply_fd, out, err, *lock) = json.loads(message), fds  # lock: the run folder's, held by the guard
        reply = socket.socket(fileno=reply_fd)

        def guard_of(r: dict = request, o: int = out, e: int = err) -> int:
            for s in (sock, reply, *waiting.values()):  # the other launches' sockets are not this one's
                s.close()
            os.chdir(r["cwd"])
            return guard_forked(r["cmd"], r["stall"], r["grace"], r["startup"], os.getppid(), r["env"], o, e)

        pid = forking.fork(guard_of)
        for f in (out, err, *lock):
            os.close(f)
        with contextlib.suppress(OSError):
            reply.send(json.dumps({"pid": pid}).encode())
        waiting[pid] = reply
    return 0


def _import_while_the_caller_lives(modules: list[str], caller: int) -> None:
    """Import ``modules`` (seconds: torch and Lightning) while a thread checks every 0.1 s that ``caller`` is
    still this process's parent and ends the process (``os._exit(0)``: nothing started yet) when it is not: a
    caller that refused its input at once left its zygote importing, busy, 8-13 s after it had ended. The
    thread is joined before this returns (the zygote forks with one Python thread). Raises what an import
    raises."""
    import importlib

    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.1):
            if os.getppid() != caller:
                os._exit(0)

    watcher = threading.Thread(target=watch, name="zygote-caller-watch", daemon=True)
    watcher.start()
    try:
        for name in modules:
            importlib.import_module(name)
    finally:
        done.set()
        watcher.join()
