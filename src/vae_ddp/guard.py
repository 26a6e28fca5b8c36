"""Every process tree this project starts ends: a guard process, a watchdog and a heartbeat.

``python -m vae_ddp.guard [--timeout S] [--stall S] -- CMD ...`` runs ``CMD`` under a guard, a
small process (the standard library and ``psutil``: it starts in tens of milliseconds) that

- gives ``CMD`` and all it starts (DDP ranks, DataLoader workers, a forkserver) a session of
  their own, and is the subreaper of that tree on Linux (a process that leaves the group is
  still found);
- ends the tree (SIGTERM, SIGKILL after ``--grace`` s) when ``CMD`` exits, when the guard gets
  SIGTERM, SIGINT or SIGHUP, on ``--timeout``, and when its parent dies, even by SIGKILL (it polls
  its parent and asks Linux for SIGTERM then, ``prctl(PR_SET_PDEATHSIG)``);
- is a **watchdog**: when no process beats for ``--stall`` s (``$VAE_DDP_WATCHDOG_S``, else 300)
  it sends SIGUSR1 (every rank dumps its threads' stacks, ``faulthandler``), prints the stacks,
  ends the tree and fails with one line naming each rank and the frame it was stuck in; a rank
  stopped (SIGSTOP) for ``--stall`` s is named as such and ended, even while other processes beat.

A process beats with [`beat`][vae_ddp.beats.beat]; the ``Trainer``s of this project's launches
beat through the [`Heartbeat`][vae_ddp.heartbeat.Heartbeat] callback. Exit codes: ``CMD``'s own
(128 + N when signal N ended it), 124 on ``--timeout``, 125 when the watchdog fired, 128 + N
when the guard itself got signal N (its parent's death: SIGTERM). [`run`][vae_ddp.guard.run] and
[`run_all`][vae_ddp.guard.run_all] are ``subprocess.run`` for such trees, ``how="fork"`` a Python
command in a fork of the caller (nothing imported again), ``how="zygote"`` in a fork of the caller's
zygote of its module ([`vae_ddp.zygote`][vae_ddp.zygote]), whose process is
``python -m vae_ddp.guard --zygote MODULE FD CALLER``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence

from vae_ddp.beats import _ENV_DIR, beat, how_it_ended, last_step, under_guard  # noqa: F401  (guard.beat & co.)
from vae_ddp.forking import fork, prctl, run_as_python, set_name

__all__ = ["run", "run_all", "How", "guard_forked", "guarded", "beat", "last_step", "how_it_ended",
           "under_guard", "STALLED", "TIMED_OUT", "DEFAULT_STALL_S"]

#: Exit code of the guard when ``--timeout`` passed.
TIMED_OUT = 124
#: Exit code of the guard when the watchdog fired (no progress for ``--stall`` seconds).
STALLED = 125
#: Seconds without progress before the watchdog fires, unless ``$VAE_DDP_WATCHDOG_S`` says otherwise.
DEFAULT_STALL_S = 300.0

#: How [`run_all`][vae_ddp.guard.run_all] starts a command: a new interpreter, a fork of the caller, a fork
#: of the caller's zygote of the command's module.
How = Literal["exec", "fork", "zygote"]
HOW: tuple[str, ...] = ("exec", "fork", "zygote")

_ENV_STALL = "VAE_DDP_WATCHDOG_S"
_POLL_S = 0.25


def default_stall() -> float:
    """Seconds without progress before the watchdog fires: ``$VAE_DDP_WATCHDOG_S`` or 300.

    Raises:
        vae_ddp.errors.UserError: ``$VAE_DDP_WATCHDOG_S`` is set but not a number of seconds above 0
            (``abc``, ``0``, ``-5``, ``nan``): bad input, which the commands refuse before any work.
    """
    import math

    from vae_ddp.errors import UserError

    text = os.environ.get(_ENV_STALL, "").strip()
    if not text:
        return DEFAULT_STALL_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not seconds > 0:  # nan too
        raise UserError(f"{_ENV_STALL}={os.environ[_ENV_STALL]!r} is not a number of seconds above 0: set it to the "
                        f"seconds without progress after which a run is ended (say 60), or unset it "
                        f"({DEFAULT_STALL_S:g})")
    return seconds


def guarded(cmd: Sequence[str], timeout: Optional[float] = None, stall: Optional[float] = None,
            grace: float = 10.0, startup: Optional[float] = None) -> list[str]:
    """The command line that runs ``cmd`` under a guard."""
    # the caller's pid: a guard that only read its parent at start-up would take a caller that
    # died while Python started it (its parent then already init or a subreaper) for its parent
    args = [sys.executable, "-m", "vae_ddp.guard", "--grace", str(grace), "--parent", str(os.getpid())]
    for flag, value in (("--timeout", timeout), ("--stall", stall), ("--startup", startup)):
        if value is not None:
            args += [flag, str(value)]
    return args + ["--", *map(str, cmd)]


# --------------------------------------------------------------------------- the caller's side
def run_all(cmds: Sequence[Sequence[str]], timeout: Optional[float] = None, stall: Optional[float] = None,
            grace: float = 10.0, startup: Optional[float] = None, how: How = "exec", preload: tuple[str, ...] = (),
            **popen: Any) -> list[subprocess.CompletedProcess]:
    """``subprocess.run`` for ``cmds`` at the same time, each a process tree under a guard of its
    own: on ``timeout`` (for all together), an exception or KeyboardInterrupt every tree is ended
    (``subprocess.run`` kills only its first process). ``stall``: the watchdog's limit;
    ``startup``: the time allowed before the first beat (default ``stall``); ``popen`` goes to
    ``subprocess.Popen``; ``capture_output=True`` collects the output through temporary files
    (chatty processes cannot block each other on a full pipe). ``returncode``: the guard's.

    ``how``: ``"exec"``, a new interpreter (``python -m vae_ddp.guard ... -- CMD``); ``"fork"``:
    each command is ``[sys.executable, SCRIPT or "-m", MODULE, *args]`` and runs as that command
    line would, in a fork of this process (the guard a fork too): nothing is imported again;
    ``popen`` may then give only ``env``, ``stdout`` and ``stderr`` (None, ``DEVNULL``, a
    descriptor or a file); only where [`can_fork`][vae_ddp.forking.can_fork] holds (or the caller
    knows its other threads hold no lock: an idle BLAS pool). ``"zygote"``: the same, in a fork of
    this process's zygote of ``MODULE`` ([`zygote.start`][vae_ddp.zygote.start]; a new interpreter
    where it has none), or with ``preload`` of those modules (then ``popen`` may also give ``cwd``).

    Raises:
        subprocess.TimeoutExpired: ``timeout`` passed (every tree has been ended).
        ValueError: (before anything starts) an unknown ``how``; ``"fork"`` or ``"zygote"`` with
            another command or stream.
    """
    import psutil

    capture, text = popen.pop("capture_output", False), popen.pop("text", False)
    if how not in HOW:
        raise ValueError(f"how={how!r}: use one of {', '.join(map(repr, HOW))}")
    if how != "exec":  # what run_as_python runs, checked before anything starts
        for args in ([str(a) for a in c] for c in cmds):
            module = args[1:2] == ["-m"]
            if args[0] != sys.executable or len(args) < 2 + module or args[1].startswith("-") and not module:
                raise ValueError(f"how={how!r} runs [sys.executable, SCRIPT or '-m', MODULE, *args], got {args}")
        if any(isinstance(t, int) and t < 0 and t != subprocess.DEVNULL
               for t in (popen.get("stdout"), popen.get("stderr"))):
            raise ValueError(f"how={how!r} takes stdout and stderr None, DEVNULL, a descriptor or a file")
    zygote_start = None
    if how == "zygote":
        from vae_ddp.zygote import start as zygote_start  # (the zygote's guards are guard_forked's)
    files = [(tempfile.TemporaryFile(), tempfile.TemporaryFile()) if capture else (None, None) for _ in cmds]
    procs: list = []
    try:
        for cmd, (out, err) in zip(cmds, files):
            streams = dict(popen, **(dict(stdout=out, stderr=err) if capture else {}))
            args = list(map(str, cmd))
            zygoted = zygote_start(args, stall, grace, startup, preload=preload, **streams) if zygote_start else None
            procs.append(zygoted or (psutil.Process(_in_fork(args, stall, grace, startup, **streams)) if how == "fork"
                                     else psutil.Popen(guarded(cmd, stall=stall, grace=grace, startup=startup),
                                                       **streams)))
        if psutil.wait_procs(procs, timeout)[1]:
            raise subprocess.TimeoutExpired(list(cmds[0]), timeout)
    except BaseException:  # a timeout, an exception or KeyboardInterrupt: each guard ends its tree first
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        for p in psutil.wait_procs(procs, grace + 5)[1]:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(procs)
        raise

    def read(f: Any) -> Any:
        if f is None:
            return None
        f.seek(0)
        data = f.read()
        f.close()
        return data.decode(errors="replace") if text else data

    return [subprocess.CompletedProcess(list(cmd), int(p.returncode or 0), read(out), read(err))
            for cmd, p, (out, err) in zip(cmds, procs, files)]


def run(cmd: Sequence[str], timeout: Optional[float] = None, stall: Optional[float] = None, grace: float = 10.0,
        startup: Optional[float] = None, how: How = "exec", preload: tuple[str, ...] = (),
        **popen: Any) -> subprocess.CompletedProcess:
    """[`run_all`][vae_ddp.guard.run_all] of one command: ``subprocess.run(cmd, timeout=...)`` for
    a process tree.

    Raises:
        subprocess.TimeoutExpired: ``timeout`` passed (the tree has been ended).
    """
    return run_all([cmd], timeout=timeout, stall=stall, grace=grace, startup=startup, how=how, preload=preload,
                   **popen)[0]


def _in_fork(cmd: list[str], stall: Optional[float], grace: float, startup: Optional[float],
             env: Optional[dict] = None, stdout: Any = None, stderr: Any = None) -> int:
    """Fork a guard whose command is a fork of it that runs ``python cmd[1:]`` (``run_all``'s
    ``fork``); return the guard's pid. ``stdout``, ``stderr``: None, ``subprocess.DEVNULL``, a
    descriptor or a file."""
    parent, env = os.getpid(), dict(os.environ if env is None else env)
    return fork(lambda: guard_forked(cmd, stall, grace, startup, parent, env, stdout, stderr))


def guard_forked(cmd: list[str], stall: Optional[float], grace: float, startup: Optional[float], parent: int,
                 env: dict, stdout: Any = None, stderr: Any = None) -> int:
    """Be, in this process (a fork of ``parent`` that imported what ``cmd`` needs: ``run_all``'s
    ``fork``, a [zygote][vae_ddp.zygote]), the guard of ``python cmd[1:]`` run in a fork of it;
    return its exit code. ``stdout``, ``stderr``: None (this process's), ``subprocess.DEVNULL``, a
    descriptor or a file. The forks keep the forked process's command line (``ps``); their stderr
    is the launch's log."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd, target in ((0, null), (1, stdout), (2, stderr)):
        target = null if target == subprocess.DEVNULL else target
        if target is not None:
            os.dup2(target if isinstance(target, int) else target.fileno(), fd)
    for fd in {null, *(t for t in (stdout, stderr) if isinstance(t, int) and t > 2 and t != subprocess.DEVNULL)}:
        if fd > 2:  # a descriptor given (a zygote's copy) is the command's 1 or 2 now
            os.close(fd)
    for sig in (signal.SIGINT, signal.SIGALRM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # from this environment's TMPDIR (the forked process may have cached another's)

    def start(guard_env: dict) -> int:  # the command dies with its guard, even a killed one (run_all's SIGKILL)
        return fork(lambda: run_as_python(cmd[1:], guard_env), parent_death=signal.SIGKILL)

    return _Guard(cmd, None, default_stall() if stall is None else stall, grace, startup, parent, start).main()


# --------------------------------------------------------------------------- the guard
def _role_of(proc: dict) -> str:
    """A registered process's name in the guard's messages (``proc-PID.json``): its role, else ``rank N``."""
    return proc.get("role") or f"rank {proc['rank']}"


_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+) in (\S+)', re.M)


def _where_stuck(dump: str, main_thread: Optional[int]) -> Optional[str]:
    """The innermost frame of the main thread's stack in a faulthandler dump, preferring the
    innermost one outside Python's standard library."""
    import sysconfig

    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump)
    wanted = f"0x{main_thread:016x}" if main_thread is not None else "(none)"
    frames = _FRAME.findall(next((b for b in blocks if wanted in b.split("\n", 1)[0]), blocks[0]))
    if not frames:
        return None
    stdlib = sysconfig.get_paths()["stdlib"]
    file, line, func = next((f for f in frames if "site-packages" in f[0] or not f[0].startswith(stdlib)), frames[0])
    short = next((file.split(m, 1)[1] for m in ("site-packages/", "/src/", "/examples/", "/tests/") if m in file), file)
    return f"{func} ({short}:{line})"


class _Guard:
    def __init__(self, cmd: list[str], timeout: Optional[float], stall: float, grace: float,
                 startup: Optional[float] = None, parent: Optional[int] = None,
                 start: Optional[Callable[[dict], int]] = None) -> None:
        self.cmd, self.timeout, self.stall, self.grace, self.start = cmd, timeout, stall, grace, start
        self.startup = stall if startup is None else startup
        self.signal: Optional[int] = None
        self.code: Optional[int] = None
        self.parent = os.getppid() if parent is None else parent
        self.outer = os.environ.get(_ENV_DIR)  # a guard around this one (a study run by the docs build)
        self.forwarded = 0.0
        self.stopped: dict[int, float] = {}  # pid -> since when (monotonic) a registered process is stopped
        self.checked = 0.0
        self.dir = Path()  # made in main(), once the guard runs: removed by main() however it ends

    def _on_signal(self, signum, frame) -> None:
        self.signal = signum

    def _stalled(self) -> bool:
        """No heartbeat for ``stall`` seconds (before the first one: for ``startup`` seconds).
        Under an outer guard, a new heartbeat is passed on to it (its watchdog sees the
        progress of the runs this guard watches)."""
        newest = None
        for f in self.dir.glob("beat-*"):
            with contextlib.suppress(FileNotFoundError):
                newest = max(newest or 0.0, f.stat().st_mtime)
        if newest is not None and newest > self.forwarded:
            self.forwarded = newest
            self._beat_outer()
        if newest is None:
            return time.time() - self.wall0 > self.startup
        return time.time() - max(newest, self.wall0) > self.stall

    def _stopped_too_long(self, at_least: Optional[float] = None) -> Optional[str]:
        """The registered processes (ranks) stopped (SIGSTOP: state T) for ``at_least`` seconds
        (default ``stall``), named: ``"rank 1 (PID 123) is stopped (SIGSTOP), not running"``; None if
        there is none. The other processes may go on beating meanwhile (the one-device runs beside
        the ranks, ranks that wait for it), so the stall of the whole tree would come late or never.
        Checked once a second (``at_least`` given: now)."""
        import psutil

        now = time.monotonic()
        if at_least is None and now - self.checked < 1.0:
            return None
        self.checked = now
        at_least = self.stall if at_least is None else at_least
        stopped = {}
        for info in self.dir.glob("proc-*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError, psutil.Error):
                p = json.loads(info.read_text())
                if psutil.Process(p["pid"]).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                    stopped[p["pid"]] = (p["rank"], self.stopped.get(p["pid"], now))
        self.stopped = {pid: since for pid, (_, since) in stopped.items()}
        late = sorted((rank, pid) for pid, (rank, since) in stopped.items() if now - since >= at_least)
        return "; ".join(f"{self._role(pid)} (PID {pid}) is stopped (SIGSTOP), not running" for _, pid in late) or None

    def _beat_outer(self) -> None:
        """A beat of this guard in the folder of the guard around it, if any."""
        if self.outer:
            with contextlib.suppress(OSError):
                Path(self.outer, f"beat-{os.getpid()}").touch()

    def _reap(self) -> None:
        """Collect every exited child: the command (its exit code kept) and, the guard being a
        subreaper on Linux, any orphaned descendant."""
        with contextlib.suppress(ChildProcessError):
            while (ended := os.waitpid(-1, os.WNOHANG))[0]:
                if ended[0] == self.pid and self.code is None:
                    self.code = os.waitstatus_to_exitcode(ended[1])

    def _tree(self) -> list:
        """Live processes of the command: every descendant of the guard (``psutil``; an orphan of
        the tree is the guard's child, the guard being its subreaper on Linux); where the process
        table cannot be read (a ``/proc`` mounted with ``hidepid``), the command's own process."""
        import psutil

        try:
            found = psutil.Process().children(recursive=True)
        except (psutil.Error, OSError):
            found = []
            with contextlib.suppress(psutil.Error):
                found = [psutil.Process(self.pid)]
        tree = []
        for p in found:
            with contextlib.suppress(psutil.Error):
                if p.status() != psutil.STATUS_ZOMBIE:
                    tree.append(p)
        return tree

    def _end_tree(self) -> None:
        """SIGTERM every process of the command, SIGKILL what is left after the grace period; a
        process found later in either phase (one that forked meanwhile) gets the signal too."""
        import psutil

        for sig, wait in ((signal.SIGTERM, self.grace), (signal.SIGKILL, 5.0)):
            sent: set = set()
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                self._reap()
                tree = set(self._tree())
                if not tree:
                    return
                for p in tree - sent:
                    with contextlib.suppress(psutil.Error):
                        p.send_signal(sig)
                        if sig == signal.SIGTERM:  # a stopped process acts on it only once continued
                            p.send_signal(signal.SIGCONT)
                sent |= tree
                time.sleep(0.1)

    def _dump(self) -> str:
        """SIGUSR1 to every process (faulthandler dumps in each rank), then one phrase per process that still
        runs, by its role (``rank 1``, ``one device's process``, with its PID where two share a role); a
        stopped process (named by ``_stopped_too_long``) and one that has exited are not named."""
        import psutil

        procs = []
        for info in self.dir.glob("proc-*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError, psutil.Error):
                p = json.loads(info.read_text())
                if psutil.Process(p["pid"]).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD,
                                                            psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                    procs.append(p)
        for p in procs:  # only the processes that registered a dump: SIGUSR1 would end the others
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p["pid"], signal.SIGUSR1)
        time.sleep(2.0)
        parts, names = [], []
        roles = [_role_of(p) for p in procs]
        for p in sorted(procs, key=lambda p: (_role_of(p), p["pid"])):
            role = _role_of(p)
            who = role if roles.count(role) == 1 else f"{role} (PID {p['pid']})"
            stacks = self.dir / f"stacks-{p['pid']}.txt"
            dump = stacks.read_text(errors="replace") if stacks.exists() else ""
            parts.append(f"--- {role} (pid {p['pid']}) ---\n{dump.rstrip() or '(no stacks: not responding)'}")
            where = _where_stuck(dump, p.get("main_thread"))
            names.append(f"{who} in {where or 'an unknown frame (no stack dumped)'}")
        sys.stderr.write("\n".join(parts) + ("\n" if parts else ""))
        return "; ".join(names) or "no process had started training (no heartbeat, no stacks)"

    def main(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        set_name("vae-ddp guard")
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: SIGTERM when the parent dies, even by SIGKILL
        prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphaned ranks and workers become the guard's children
        if os.getppid() != self.parent:  # the parent died before prctl
            return 128 + signal.SIGTERM
        if os.getpgrp() != os.getpid():
            os.setsid()  # a session of its own: the command and all it starts share the guard's group
        self.dir = Path(tempfile.mkdtemp(prefix="vae-ddp-guard-"))
        try:
            env = dict(os.environ, **{_ENV_DIR: str(self.dir)})
            self.t0, self.wall0 = time.monotonic(), time.time()
            self._beat_outer()  # a command that starts is progress for the guard around this one
            if self.start is not None:  # run(how="fork"): the command is a fork of this process
                self.pid = self.start(env)
            else:
                try:
                    child = subprocess.Popen(self.cmd, env=env)
                except OSError as err:
                    sys.stderr.write(f"vae-ddp guard: cannot start {self.cmd[0]}: {err}\n")
                    return 127
                self.pid = child.pid
                child.returncode = 0  # the guard reaps it (os.waitpid); Popen must not
            return self._watch()
        finally:
            import shutil

            shutil.rmtree(self.dir, ignore_errors=True)

    def _watch(self) -> int:
        while True:
            self._reap()
            if self.code is not None:
                if self.code < 0 and self.signal is None:  # not our doing: name the process and the signal
                    sys.stderr.write(f"vae-ddp: rank {self._rank(self.pid)} (PID {self.pid}) "
                                     f"{how_it_ended(self.code, self.pid, self.dir)}\n")
                self._end_tree()  # stray ranks or workers of a finished command
                return self.code if self.code >= 0 else 128 - self.code
            if self.signal is not None or os.getppid() != self.parent:
                self._end_tree()
                return 128 + (self.signal or signal.SIGTERM)
            timed_out = self.timeout is not None and time.monotonic() - self.t0 > self.timeout
            stopped = None if timed_out else self._stopped_too_long()
            if timed_out or stopped or self._stalled():
                named = stopped or self._stopped_too_long(at_least=0.0)  # a stopped rank is named first
                where = self._dump() if not named else named + "; " + self._dump()
                self._end_tree()
                text = " ".join(" ".join(c.split()) for c in self.cmd)
                cmd = f"`{text[:120]}{'...' if len(text) > 120 else ''}`"
                why = f"{cmd} timed out after {self.timeout:g} s" if timed_out else \
                    f"a process was stopped for {self.stall:g} s in {cmd}" if stopped else \
                    f"no process made progress for {self.stall:g} s in {cmd}"
                sys.stderr.write(f"vae-ddp guard: {why}; {where} "
                                 "(every rank's stacks above; all its processes ended)\n")
                return TIMED_OUT if timed_out else STALLED
            time.sleep(_POLL_S)

    def _role(self, pid: int) -> str:
        """What process ``pid`` registered itself as (``rank 1``, ``one device's process``)."""
        try:
            return _role_of(json.loads((self.dir / f"proc-{pid}.json").read_text()))
        except (OSError, ValueError, KeyError):
            return f"rank {self._rank(pid)}"

    def _rank(self, pid: int) -> int:
        """The rank process ``pid`` registered with its first heartbeat (0 if none)."""
        try:
            return int(json.loads((self.dir / f"proc-{pid}.json").read_text())["rank"])
        except (OSError, ValueError, KeyError):
            return 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vae_ddp.guard", description=__doc__.split("\n\n")[0])
    p.add_argument("--timeout", type=float, default=None, help="seconds before the whole tree is ended (exit 124)")
    p.add_argument("--stall", type=float, default=None,
                   help=f"seconds without progress before the watchdog fires (exit 125; default ${_ENV_STALL} or "
                        f"{DEFAULT_STALL_S:g})")
    p.add_argument("--startup", type=float, default=None,
                   help="seconds allowed before the first heartbeat (default: the --stall value)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL (default 10)")
    p.add_argument("--parent", type=int, default=None,
                   help="the caller's pid: the tree ends when the guard's parent is no longer it (default: the "
                        "parent at start-up)")
    p.add_argument("--zygote", nargs=3, metavar=("MODULE", "FD", "CALLER"),
                   help="be the zygote of MODULE for the process CALLER, on the socket FD (vae_ddp.zygote)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ...")
    args = p.parse_args(argv)
    if args.zygote:
        from vae_ddp import zygote

        return zygote.serve(args.zygote[0], int(args.zygote[1]), int(args.zygote[2]), guard_forked)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("no command: python -m vae_ddp.guard [options] -- CMD ...")
    stall = args.stall if args.stall is not None else default_stall()
    return _Guard(cmd, args.timeout, stall, args.grace, args.startup, args.parent).main()


if __name__ == "__main__":
    sys.exit(main())
