"""What a run creates is its own: the output folder's lock follows no link and uses no other
user's file, the run's TMPDIR is made anew even when a folder of its name exists, and a file
written whole (``replacing``) never writes through a link planted under its temporary name.
In-process, no training: well under a second each."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)


def test_the_lock_follows_no_link_planted_in_the_folder(tmp_path):
    """A neighbour plants ``.vae-ddp.lock`` as a link to a file of the user's (a --out under /tmp):
    the run is refused in one line and the link's target is not touched (it was truncated and
    overwritten with the lock's JSON)."""
    from vae_ddp.errors import UserError
    from vae_ddp.utils import LOCK_NAME, out_folder_lock

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).symlink_to(victim)
    with pytest.raises(UserError, match=r"holds \.vae-ddp\.lock as a link to .*victim\.txt: not written through"):
        with out_folder_lock(out, "vae-ddp audit"):
            pass
    assert victim.read_text() == "precious"
    (out / LOCK_NAME).unlink()
    (out / LOCK_NAME).symlink_to(tmp_path / "nothing-yet")  # a dangling link: not created through either
    with pytest.raises(UserError, match="as a link"):
        with out_folder_lock(out, "vae-ddp audit"):
            pass
    assert not (tmp_path / "nothing-yet").exists()


def test_the_lock_uses_no_hard_link_or_other_users_file(tmp_path):
    """A lock file that is a second name of another file (a hard link) is not written either."""
    from vae_ddp.errors import UserError
    from vae_ddp.utils import LOCK_NAME, out_folder_lock

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    os.link(victim, out / LOCK_NAME)
    with pytest.raises(UserError, match="not a plain file of yours"):
        with out_folder_lock(out, "vae-ddp audit"):
            pass
    assert victim.read_text() == "precious"


def test_a_run_tmpdir_is_made_anew_when_its_name_is_taken(tmp_path, monkeypatch):
    """``$TMPDIR/vae-ddp-run-<pid>`` made by someone else before the run (another user's, or a
    link): the run makes a folder of its own (mode 0700) instead of falling back to the shared
    TMPDIR without a word, and leaves the other one as it was."""
    from vae_ddp.utils import RUN_TMP, private_tmpdir

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    taken = tmp_path / f"{RUN_TMP}{os.getpid()}"
    taken.mkdir()
    (taken / "theirs").write_text("x")
    with private_tmpdir() as mine:
        assert mine is not None and mine != taken and mine.parent == tmp_path, mine
        assert tempfile.gettempdir() == str(mine) and os.environ["TMPDIR"] == str(mine)
        assert (os.stat(mine).st_mode & 0o777) == 0o700 and not mine.is_symlink()
        with private_tmpdir() as inner:  # a run inside this run: the same folder
            assert inner == mine
    assert not mine.exists() and (taken / "theirs").read_text() == "x"
    assert os.environ["TMPDIR"] == str(tmp_path)


def test_replacing_writes_no_file_through_a_planted_link(tmp_path):
    """The temporary name a file is written under before its rename is new and random: a link
    planted under the name it had (``.NAME.<pid>.vae-ddp-tmp``) is not written through."""
    from vae_ddp.outputs import write_atomic

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / f".audit.json.{os.getpid()}.vae-ddp-tmp").symlink_to(victim)
    write_atomic(out / "audit.json", "{}")
    assert victim.read_text() == "precious" and (out / "audit.json").read_text() == "{}"
    assert not (out / "audit.json").is_symlink()
    assert (os.stat(out / "audit.json").st_mode & 0o777) == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_result_set_folder_is_made_anew_beside_out(tmp_path):
    """The fresh folder a result set is written into beside --out (or inside it) is made by the run
    (a random name): links planted under the names it had neither receive the results nor stop the
    run (it failed with FileExistsError)."""
    from vae_ddp.outputs import result_set

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / f".out.vae-ddp-new-{os.getpid()}").symlink_to(elsewhere)
    (out / f".vae-ddp-new-{os.getpid()}").symlink_to(elsewhere)
    with result_set(out) as new:
        (new / "results.json").write_text("{}")
    assert (out / "results.json").read_text() == "{}" and list(elsewhere.iterdir()) == []
    assert Path(tmp_path / f".out.vae-ddp-new-{os.getpid()}").is_symlink()  # theirs, left alone


def test_a_live_runs_tmpdir_is_kept_whatever_its_pid(tmp_path, monkeypatch):
    """A run's folder is removed by the next run only when its run is gone: its owner's lock is free.
    A live run whose PID this process cannot see (another PID namespace sharing ``/tmp``: a container,
    a sandbox) keeps its folder; once its lock is released, the folder goes."""
    import fcntl

    from vae_ddp.utils import RUN_TMP, RUN_TMP_OWNER, private_tmpdir

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    theirs = tmp_path / f"{RUN_TMP}999999999-abc"  # no such PID here
    theirs.mkdir(mode=0o700)
    fd = os.open(theirs / RUN_TMP_OWNER, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # its run is alive, as a process of another namespace
    try:
        with private_tmpdir() as mine:
            assert mine is not None and (mine / RUN_TMP_OWNER).is_file()
        assert theirs.is_dir(), "a live run's folder was removed"
    finally:
        os.close(fd)
    with private_tmpdir():
        pass
    assert not theirs.exists()
