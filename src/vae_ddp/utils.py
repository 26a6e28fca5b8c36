"""Small helpers shared by the examples and the studies."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

from vae_ddp.errors import UserError

if TYPE_CHECKING:
    from subprocess import Popen

__all__ = ["quiet", "close_process_group", "check_writable", "out_folder_lock", "FolderInUse", "private_tmpdir",
           "inductor_folder_to_remove", "remove_if_empty"]


class FolderInUse(UserError):
    """Another live run holds the output folder (its PID and command in the message): bad input, exit 2."""


@contextlib.contextmanager
def out_folder_lock(out_dir: "str | Path", command: str) -> Iterator[Path]:
    """Hold ``out_dir`` for this run: an exclusive ``fcntl.flock`` on ``out_dir/.vae-ddp.lock``,
    which names this process and ``command``. The lock file is opened without following a link
    (``O_NOFOLLOW``) and used only when it is a plain file of this user's: a link or another
    user's file planted there is never written through. The kernel releases the lock when every process
    holding it has ended (the ranks and workers forked from this one inherit it), so a lock left by
    a run that was killed is taken over at once; the file is removed when this run ends, and so
    are the folders the lock created if the run wrote nothing into them (bad input found by the
    study leaves no folder behind).

    Raises:
        FolderInUse: a live run holds the folder: the message names its PID and command.
        UserError: ``.vae-ddp.lock`` there is a link, not a plain file, or another user's.
    """
    import fcntl
    import json
    import os
    import stat

    path = Path(out_dir) / LOCK_NAME
    created, p = [], path.parent
    while not p.exists():
        created.append(p)
        p = p.parent
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:  # never through a link planted in a folder another user can write (a --out under /tmp)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError:
            if not os.path.islink(path):
                raise
            raise UserError(f"--out {out_dir} holds {LOCK_NAME} as a link to {os.readlink(path)}: not written "
                            f"through; remove the link, or choose a folder of your own as --out") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_nlink != 1:
            os.close(fd)
            raise UserError(f"--out {out_dir} holds a {LOCK_NAME} that is not a plain file of yours (owner uid "
                            f"{info.st_uid}): not written; remove it, or choose a folder of your own as --out")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                other = json.loads(os.read(fd, 65536) or b"{}")
            except ValueError:
                other = {}
            os.close(fd)
            raise FolderInUse(f"--out {out_dir} is in use by another run (PID {other.get('pid', '?')}: "
                              f"{other.get('command', '?')}): wait for it to end, or choose another --out") from None
        if os.path.exists(path) and os.stat(path).st_ino == os.fstat(fd).st_ino:
            break  # still the file at that path (not one a finishing run removed meanwhile)
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "command": command}).encode())
    from vae_ddp.outputs import clean_stale

    clean_stale(out_dir)  # what a killed run into this folder left of its writes
    try:
        yield Path(out_dir)
    finally:
        path.unlink(missing_ok=True)  # still ours: the lock is held until the close below
        os.close(fd)
        for folder in created:  # deepest first; one the run wrote into stays
            try:
                folder.rmdir()
            except OSError:
                break


#: The lock file of a run's output folder (``out_folder_lock``).
LOCK_NAME = ".vae-ddp.lock"
#: The prefix of a run's own temporary folder (``private_tmpdir``), followed by its PID and a random part.
RUN_TMP = "vae-ddp-run-"
#: The file in a run's temporary folder that its run holds an exclusive ``flock`` on while it lives.
RUN_TMP_OWNER = ".owner"
#: The file in a run's temporary folder that lists the folders outside it to remove with it if empty.
RUN_TMP_ALSO = ".also-if-empty"


@contextlib.contextmanager
def private_tmpdir(also_if_empty: tuple[str, ...] = ()) -> Iterator[Optional[Path]]:
    """A temporary folder of this run's own as ``TMPDIR`` (and ``tempfile.tempdir``) while the
    block runs, removed with all that the run's processes left in it when the block ends, however
    it ends (an exception, ``KeyboardInterrupt``, SIGTERM raised as an exception): DataLoader
    workers' ``pymp-*`` folders and forkserver sockets, torch inductor's ``torchinductor_*``
    cache (``TORCHINDUCTOR_CACHE_DIR`` points into the folder while the block runs, unless it names a folder
    other than inductor's default: the user's choice), torch elastic's folders, the guards' heartbeat
    folders. The folder is made anew
    (``tempfile.mkdtemp``: ``RUN_TMP``, the PID and a random part, mode 0700), so that a folder or
    link of that name made by another user is never used. The run holds an exclusive ``flock`` on the
    folder's ``RUN_TMP_OWNER`` file while it lives (a PID is no proof: a run in another PID namespace, such
    as another container sharing ``/tmp``, has a PID this one cannot see), and a small process of the
    standard library alone (``REAPER``, in a session of its own, SIGINT ignored) waits for that lock: when
    SIGKILL ends the run, and every process forked from it that holds the lock has ended too, it removes
    the folder and the empty ones ``also_if_empty`` names, and ends; when the block ends, the run removes
    the folder and waits for it. A folder whose reaper could not run (killed itself) is removed by the next run of this
    user's. Where the temporary folder cannot be written, nothing changes (yields None).
    Blocks of one process share its folder (a block inside another, or the calls of several threads: the
    environment is the process's): the last to end removes it and sets ``TMPDIR`` back.
    ``also_if_empty``: folders outside it that the command made (the inductor cache its imports made in
    TMPDIR), written into the folder (``RUN_TMP_ALSO``) so that the reaper removes them too if they are
    empty.
    """
    import tempfile

    with _RUNS_LOCK:
        base = tempfile.gettempdir()
        own = _own_run_tmpdir(base)  # inside a run of this process, or beside it in another thread: its folder,
        shared = own and base in _RUNS  # removed by the last block to leave
        if shared:
            _RUNS[base]["users"] += 1
    if own:
        try:
            yield Path(base)
        finally:
            if shared:
                _leave(base)
        return
    _remove_dead_tmpdirs(Path(base))
    try:  # a short name: a DataLoader's forkserver socket path in it must stay under 108 characters
        path = tempfile.mkdtemp(prefix=f"{RUN_TMP}{os.getpid()}-", dir=base)
    except OSError:
        yield None
        return
    import fcntl

    owner = os.open(os.path.join(path, RUN_TMP_OWNER), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    fcntl.flock(owner, fcntl.LOCK_EX)  # held while this run lives; released by the kernel however it ends
    if also_if_empty:
        with contextlib.suppress(OSError):
            Path(path, RUN_TMP_ALSO).write_text(json.dumps(list(also_if_empty)))
    with _RUNS_LOCK:
        _RUNS[path] = {"users": 1, "owner": owner, "reaper": _start_reaper(path), "tempdir": tempfile.tempdir,
                       "env": {"TMPDIR": os.environ.get("TMPDIR"), INDUCTOR_CACHE: os.environ.get(INDUCTOR_CACHE)}}
        saved_cache = os.environ.get(INDUCTOR_CACHE)
        os.environ["TMPDIR"], tempfile.tempdir = path, path
        if saved_cache is None or os.path.abspath(saved_cache) == _inductor_default(base):  # not the user's choice
            os.environ[INDUCTOR_CACHE] = os.path.join(path, "torchinductor")
    try:
        yield Path(path)
    finally:
        _leave(path)


#: The run folders this process made (``private_tmpdir``) and in use: how many blocks use each (threads of the
#: process; a block inside another), the descriptor of its ``RUN_TMP_OWNER`` lock, its reaper, what it replaced.
_RUNS: dict[str, dict] = {}
_RUNS_LOCK = threading.Lock()


def _leave(path: str) -> None:
    """A block of ``private_tmpdir`` ends: the last to leave the folder ``path`` sets ``TMPDIR`` back, removes the
    folder and waits for its reaper."""
    import shutil
    import tempfile

    with _RUNS_LOCK:
        run = _RUNS[path]
        run["users"] -= 1
        if run["users"]:
            return
        del _RUNS[path]
        _restore_env(run["env"])
        tempfile.tempdir = run["tempdir"]
    _release_multiprocessing(path)
    shutil.rmtree(path, ignore_errors=True)
    os.close(run["owner"])  # the reaper wakes, finds the folder gone and ends
    if run["reaper"] is not None:
        with contextlib.suppress(Exception):
            run["reaper"].wait(timeout=10)


def run_lock(tmpdir: Optional[str]) -> Optional[int]:
    """The descriptor that holds the lock of the run folder ``tmpdir`` (a ``TMPDIR``), if this process made it
    (``private_tmpdir``) and it is in use, else None. A process given it (forked, or sent it) holds the lock
    with the run: the folder's reaper then waits for that process as well before it removes the folder."""
    with _RUNS_LOCK:
        run = _RUNS.get(os.path.abspath(tmpdir)) if tmpdir else None
        return run["owner"] if run else None


#: The program of the process that removes a run folder once its run is gone (``private_tmpdir``): the
#: standard library only (milliseconds to start); argv: the folder, ``RUN_TMP_OWNER``, ``RUN_TMP_ALSO``.
#: It blocks on the folder's ``RUN_TMP_OWNER`` lock, which the kernel releases when the last process holding
#: it ends, however it ends.
REAPER = """
import ctypes, fcntl, json, os, shutil, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
try:
    ctypes.CDLL(None).prctl(15, ctypes.c_char_p(b"vae-ddp reaper"), 0, 0, 0)  # PR_SET_NAME: what ps -eo comm shows
except (OSError, AttributeError):
    pass
path, owner, also_file = sys.argv[1:4]
try:
    fd = os.open(os.path.join(path, owner), os.O_RDONLY | os.O_NOFOLLOW)
except OSError:
    sys.exit(0)
fcntl.flock(fd, fcntl.LOCK_EX)
try:
    with open(os.path.join(path, also_file)) as f:
        also = [str(p) for p in json.load(f)]
except (OSError, ValueError, TypeError):
    also = []
shutil.rmtree(path, ignore_errors=True)
for folder in also:
    try:
        os.rmdir(folder)
    except OSError:
        pass
"""


def _start_reaper(path: str) -> "Optional[Popen]":
    """Start ``REAPER`` for the run folder ``path`` (after this process took its lock), in a session of its
    own so that a signal to the run's process group does not end it first; None where it cannot start."""
    import subprocess
    import sys

    try:
        return subprocess.Popen([sys.executable, "-I", "-S", "-c", REAPER, path, RUN_TMP_OWNER, RUN_TMP_ALSO],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError:
        return None


#: torch inductor's cache folder setting; unset, ``cache_dir()`` in torch/_inductor/runtime/cache_dir_utils.py
#: uses TMPDIR/torchinductor_USER, which importing Lightning creates and then names in this variable
INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"


def _inductor_default(base: str) -> str:
    """Inductor's default cache folder in ``base`` (its ``default_cache_dir``: ``torchinductor_`` and the user)."""
    import getpass
    import re

    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(os.path.abspath(base), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def _restore_env(saved: dict[str, Optional[str]]) -> None:
    """Set each variable of ``saved`` back to its value (None: unset)."""
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def inductor_folder_to_remove() -> Optional[str]:
    """Before a command imports torch and Lightning: inductor's default cache folder in TMPDIR when
    ``TORCHINDUCTOR_CACHE_DIR`` is unset and that folder does not exist (the imports create it, empty:
    [`remove_if_empty`][vae_ddp.utils.remove_if_empty] it when the command ends), else None: a cache that
    existed before, or the user's, is never removed. Raises nothing."""
    import tempfile

    if os.environ.get(INDUCTOR_CACHE) is not None:
        return None
    path = _inductor_default(tempfile.gettempdir())
    return None if os.path.lexists(path) else path


def remove_if_empty(path: Optional[str]) -> None:
    """Remove the folder ``path`` if it is empty (not a link, nothing in it); else leave it. Raises nothing."""
    if path:
        with contextlib.suppress(OSError):
            os.rmdir(path)


def _release_multiprocessing(path: str) -> None:
    """What this process's ``multiprocessing`` keeps under ``path``: a forkserver listening there
    is stopped (the next DataLoader starts another), its ``pymp-*`` folder removed by its own
    finalizer now (it would fail to find it at exit)."""
    import sys

    if "multiprocessing.forkserver" in sys.modules:
        from multiprocessing import forkserver

        server = forkserver._forkserver
        if server._forkserver_address and str(server._forkserver_address).startswith(path):
            server._stop()
    if "multiprocessing.util" in sys.modules:
        from multiprocessing import util

        for f in list(util._finalizer_registry.values()):
            if getattr(f, "_callback", None) is util._remove_temp_dir and str(f._args[1]).startswith(path):
                f()


def _own_run_tmpdir(path: str) -> bool:
    """Whether ``path`` is the run folder ``private_tmpdir`` made for this process: named after its
    PID, a folder (not a link) of this user's, mode 0700."""
    import stat

    name = os.path.basename(os.path.normpath(path))
    if not name.startswith(f"{RUN_TMP}{os.getpid()}-"):
        return False
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700


def _run_gone(d: Path) -> bool:
    """Whether the run of the folder ``d`` is gone: nobody holds the lock on its ``RUN_TMP_OWNER`` file;
    a folder without one (made before the lock) by its PID."""
    import errno
    import fcntl

    from vae_ddp.ranks import alive

    try:
        fd = os.open(d / RUN_TMP_OWNER, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        pid = d.name[len(RUN_TMP):].split("-")[0]
        return pid.isdigit() and not alive(int(pid))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as err:
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        return False
    finally:
        os.close(fd)


def remove_run_folder(path: Path) -> None:
    """Remove the run folder ``path`` (of a run that is gone) and the folders its ``RUN_TMP_ALSO`` lists, those
    only if empty. Raises nothing."""
    import shutil

    also = []
    with contextlib.suppress(OSError, ValueError):
        also = [str(p) for p in json.loads((path / RUN_TMP_ALSO).read_text())]
    shutil.rmtree(path, ignore_errors=True)
    for folder in also:
        remove_if_empty(folder)


def _remove_dead_tmpdirs(base: Path) -> None:
    """Remove the run folders (``RUN_TMP``) of this user's under ``base`` whose run is gone (killed by
    SIGKILL): ``_run_gone``."""
    import stat

    for d in base.glob(f"{RUN_TMP}*"):
        try:
            info = d.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and _run_gone(d):
            remove_run_folder(d)


def quiet() -> None:
    """Silence Lightning's informational chatter in child processes (warnings stay on stderr)."""
    for name in ("pytorch_lightning", "lightning_fabric", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*`max_epochs` was not set.*")


def close_process_group() -> None:
    """Destroy the default process group after a successful run, on every rank.

    Lightning 2.6 leaves it alive after ``fit`` (it destroys it only on an exception); gloo's
    worker threads are then destroyed during interpreter finalization, which now and then
    aborts the process with "terminate called without an active exception" after the run
    has finished (pytorch/pytorch#190489: calling ``destroy_process_group`` avoids it). The
    barrier lets every rank finish its last collective before rank 0, which hosts the
    TCPStore, tears down. Not called after a failure (a rank may be inside a collective;
    pytorch/torchtitan#1342).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def check_writable(out_dir: "str | Path") -> Path:
    """``out_dir`` as a ``Path`` once it is known to be a folder that can be created and written
    into: checked before any training by creating it and a scratch file, then removing what the
    check created (a mistyped path leaves nothing behind).

    Raises:
        NotADirectoryError: ``out_dir`` is a file.
        PermissionError: it cannot be created or written (any ``OSError`` there).
    """
    import os
    import tempfile

    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"out_dir {out} is a file, not a folder: choose a folder path")
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
        raise PermissionError(f"out_dir {out} is not writable ({err.strerror or err}): choose a folder you can write "
                              "to") from None
    finally:
        for d in created:  # deepest first
            try:
                d.rmdir()
            except OSError:
                pass
    return Path(out_dir)
