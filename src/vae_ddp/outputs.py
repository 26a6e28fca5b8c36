"""Output files that a kill at any moment leaves whole: the old complete set or the new one.

- [`replacing`][vae_ddp.outputs.replacing]: one file, written under a temporary name in its own
  folder and renamed over the old one (``os.replace``): never an empty or half-written file.
- [`result_set`][vae_ddp.outputs.result_set]: a study's results (``results.json``, figures,
  tables) written into a fresh folder beside ``--out`` that then takes the place of ``--out`` in
  one ``renameat2(RENAME_EXCHANGE)``; the rest of ``--out`` (its runs, the lock, files of the
  user's) is carried into the new folder as hard links first. A kill before the exchange leaves
  the old folder as it was, a kill after it the new one; the folder left beside ``--out`` is
  removed by the next run into it ([`clean_stale`][vae_ddp.outputs.clean_stale]). Where the file
  system cannot exchange (``--out`` a mount point, a file system without ``renameat2``) each file
  is renamed into place on its own.
- [`OutOfSpace`][vae_ddp.outputs.OutOfSpace]: a full file system, named in one line with the
  folder and the size needed where known; nothing half-written is left.

Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Iterator, Optional

from vae_ddp.errors import RunFailed, UserError

__all__ = ["replacing", "write_atomic", "drop_tensors", "own_folder", "result_set", "clean_stale", "OutOfSpace",
           "NoSpaceForRun", "check_space", "no_space", "megabytes"]

_TMP = ".vae-ddp-tmp"
_NEW, _OLD = "vae-ddp-new", "vae-ddp-old"


def megabytes(n: float) -> str:
    """``n`` bytes for a reader: ``"1.5 GB"``, ``"3.2 MB"``, ``"12.0 kB"`` or ``"512 bytes"``."""
    if n >= 1e9:
        return f"{n / 1e9:.1f} GB"
    if n >= 1e6:
        return f"{n / 1e6:.1f} MB"
    return f"{n / 1e3:.1f} kB" if n >= 1e3 else f"{int(n)} bytes"


class OutOfSpace(RunFailed):
    """The file system of ``folder`` filled up while a run wrote (``ENOSPC``), after training
    started (a failed run: ``vae-ddp`` and ``vae-ddp audit`` exit 3); ``str()`` is one line naming
    the folder, the size needed where known and what is free. ``errno`` is ``ENOSPC``."""

    errno = errno.ENOSPC

    def __init__(self, folder: "str | Path", needed: Optional[int] = None) -> None:
        free = _free(folder)
        need = f"; about {megabytes(needed)} needed" if needed else ""
        super().__init__(f"no space left on the file system of {folder}{need}, {megabytes(free)} free: free some "
                         f"space or choose another --out")
        self.folder, self.needed = Path(folder), needed


class NoSpaceForRun(UserError):
    """Not enough free space in the output folder for what a run will write, found before it
    starts (bad input: exit 2)."""


def _free(folder: "str | Path") -> int:
    p = Path(folder)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return 0


def no_space(err: BaseException, folder: "str | Path") -> bool:
    """Whether ``err`` (or its cause) is a full file system under ``folder``: ``ENOSPC``, or an
    error of torch's zip writer (``unexpected pos``, ``file write failed``) while less than
    1 MiB is free there."""
    seen = set()
    e: Optional[BaseException] = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(e, RuntimeError) and any(s in str(e) for s in ("unexpected pos", "file write failed",
                                                                     "No space left")):
            return _free(folder) < 2 ** 20
        e = e.__cause__ or e.__context__
    return False


def check_space(folder: "str | Path", needed: int) -> None:
    """Refuse a run whose outputs (about ``needed`` bytes) do not fit in ``folder``'s file system.

    Raises:
        NoSpaceForRun: less than ``needed`` bytes free (the message names both and the folder).
    """
    free = _free(folder)
    if free < needed:
        raise NoSpaceForRun(f"the file system of {folder} has {megabytes(free)} free, the run writes about "
                            f"{megabytes(needed)}: free some space or choose another --out")


@contextlib.contextmanager
def replacing(path: "str | Path", needed: Optional[int] = None) -> Iterator[Path]:
    """A temporary path in ``path``'s folder to write ``path`` to; renamed over ``path`` when the
    block ends without an exception, removed when it raises. ``needed``: the file's expected size
    in bytes, for the message of a full file system. The temporary file is created here, empty,
    under a name with a random part (``O_CREAT | O_EXCL``: never a file or link someone else
    made there), with the mode a new file gets (0666 less the umask).

    Raises:
        OutOfSpace: the file system is full (what was written is removed).
    """
    path = Path(path)
    tmp: Optional[Path] = None
    try:
        tmp = _new_file(path.parent, f".{path.name}.{os.getpid()}.", _TMP)
        yield tmp
        os.replace(tmp, path)
    except BaseException as err:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()
        if isinstance(err, Exception) and not isinstance(err, OutOfSpace) and no_space(err, path.parent):
            raise OutOfSpace(path.parent, needed) from err
        raise


def _new_file(folder: Path, prefix: str, suffix: str) -> Path:
    """A new empty file ``folder/prefix<random>suffix``, created by this call (``O_EXCL``, which
    follows no link), mode 0666 less the umask."""
    import secrets

    while True:
        tmp = folder / f"{prefix}{secrets.token_hex(4)}{suffix}"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


def write_atomic(path: "str | Path", data: "str | bytes") -> Path:
    """Write ``data`` to ``path`` through [`replacing`][vae_ddp.outputs.replacing]; return ``path``.

    Raises:
        OutOfSpace: the file system is full (nothing written).
    """
    with replacing(path, len(data)) as tmp:
        if isinstance(data, str):
            tmp.write_text(data)
        else:
            tmp.write_bytes(data)
    return Path(path)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False
    where the system or file system cannot."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _link_tree(src: Path, dst: Path) -> None:
    """Carry into ``dst`` every entry of ``src`` that ``dst`` does not have: files as hard links,
    folders recursively, symbolic links as they are."""
    for entry in os.scandir(src):
        target = dst / entry.name
        if entry.is_dir(follow_symlinks=False):
            if not target.exists():
                target.mkdir()
            if target.is_dir() and not target.is_symlink():
                _link_tree(Path(entry.path), target)
        elif not os.path.lexists(target):
            if entry.is_symlink():
                os.symlink(os.readlink(entry.path), target)
            else:
                os.link(entry.path, target, follow_symlinks=False)


def _stale(out: Path) -> list[Path]:
    parent = out.parent
    beside = [p for p in parent.glob(f".{out.name}.{_NEW}-*")] + [p for p in parent.glob(f".{out.name}.{_OLD}-*")]
    inside = list(out.glob(f".{_NEW}-*")) if out.is_dir() else []
    tmps = [p for p in out.rglob(f"*{_TMP}")] if out.is_dir() else []
    return beside + inside + tmps


def clean_stale(out_dir: "str | Path") -> None:
    """Remove what a run into ``out_dir`` that was killed left of its writes (a new or old result
    set beside the folder, temporary files). Call with the folder's lock held."""
    for p in _stale(Path(out_dir).resolve()):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()


@contextlib.contextmanager
def result_set(out_dir: "str | Path") -> Iterator[Path]:
    """A fresh folder to write a study's result files into; when the block ends without an
    exception they replace those of ``out_dir`` as one (see the module's docstring); when it
    raises, nothing of them is left and ``out_dir`` is as it was.

    Raises:
        OutOfSpace: the file system is full (the new set is removed, the old one stays).
    """
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        cwd = Path.cwd()
    except OSError:
        cwd = None
    mode = stat.S_IMODE(out.stat().st_mode)
    try:
        if cwd is not None and (cwd == out or out in cwd.parents):
            raise IsADirectoryError(out)  # this process works inside --out: the folder stays the same
        # made anew under a random name (mkdtemp: never a folder or link someone else made), with --out's mode
        new = Path(tempfile.mkdtemp(prefix=f".{out.name}.{_NEW}-{os.getpid()}-", dir=out.parent))
        whole = True
    except OSError:  # the parent is not writable, or the cwd is inside: a folder inside, its files renamed one by one
        new = Path(tempfile.mkdtemp(prefix=f".{_NEW}-{os.getpid()}-", dir=out))
        whole = False
    os.chmod(new, mode)
    try:
        yield new
        _publish(new, out, whole)
    except BaseException as err:
        shutil.rmtree(new, ignore_errors=True)
        if isinstance(err, Exception) and not isinstance(err, OutOfSpace) and no_space(err, out):
            raise OutOfSpace(out) from err
        raise


def _publish(new: Path, out: Path, whole: bool) -> None:
    """``new``'s files in place of ``out``'s: in one exchange of the folders where ``whole`` and the
    file system allow it, else file by file (each file still renamed whole)."""
    if whole:
        _link_tree(out, new)
        if _exchange(new, out):
            shutil.rmtree(new, ignore_errors=True)  # now the old set
            return
    for entry in sorted(os.scandir(new), key=lambda e: e.name):
        target = out / entry.name
        if entry.is_dir(follow_symlinks=False):
            continue  # carried folders (already in out)
        if os.path.lexists(target) and os.path.samefile(entry.path, target):
            continue  # a hard link of out's own file
        os.replace(entry.path, target)
    shutil.rmtree(new, ignore_errors=True)


def own_folder(folder: "str | Path") -> None:
    """Refuse to write into ``folder`` (a folder of a run under ``--out``: its runs, a launch's
    group) when it exists as a link, or as another user's folder: the run would write and delete
    files through it (a link planted in a ``--out`` others can write). Nothing is checked where it
    does not exist yet (the run makes it).

    Raises:
        UserError: it is a link, not a folder, or not this user's (bad input: exit 2, before the runs).
    """
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        what = f"a link to {os.readlink(folder)}" if stat.S_ISLNK(info.st_mode) else "not a folder of yours"
        raise UserError(f"{folder} is {what}: the run writes there and would write through it; remove it, or "
                        "choose a folder of your own as --out")


def save_figure(fig, path: "str | Path", dpi: int = 110) -> Path:
    """``fig.savefig`` (a matplotlib figure) through [`replacing`][vae_ddp.outputs.replacing], in
    the format of ``path``'s suffix; return ``path``.

    Raises:
        OutOfSpace: the file system is full (nothing written).
    """
    path = Path(path)
    with replacing(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format=path.suffix.lstrip(".") or "png")
    return path


def drop_tensors(folder: Path) -> None:
    """Delete the tensors runs saved under ``folder`` (``*.pt``, half-written ``*.partial``) once a
    study has compared them; their logs and ``run.json`` stay. Per-step gradients and states are
    hundreds of MB for the VAE and several GB for a ResNet-18 in float64. A ``folder`` that is a
    link is left alone (not this run's: a link planted in a ``--out`` others can write)."""
    if Path(folder).is_symlink():
        return
    for saved in (*Path(folder).rglob("*.pt"), *Path(folder).rglob("*.partial")):
        saved.unlink(missing_ok=True)
