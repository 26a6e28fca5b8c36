"""Nothing left in TMPDIR: a run's DataLoader workers' pymp-* folders, torch inductor's cache and
the guards' folders go with the run (its own TMPDIR, removed when it ends); the folder of a run
killed by SIGKILL goes at the next run."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)


def _workers_and_inductor(specs, out_dir, **kwargs):
    """What the ranks leave in TMPDIR, made in this process: a forkserver DataLoader's pymp-*
    folder (its socket) and an inductor cache folder."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=2, num_workers=1,
                        multiprocessing_context="forkserver")
    assert len(list(loader)) == 2
    (Path(tempfile.gettempdir()) / "torchinductor_root").mkdir()
    from test_outputs import _canned_launch

    return _canned_launch(specs, out_dir)


@pytest.mark.parametrize("ending", ["exit 0", "SIGTERM"])
def test_a_run_leaves_nothing_in_tmpdir(tmp_path, monkeypatch, request, ending):
    """A compare whose processes made a pymp-* folder and an inductor cache leaves TMPDIR as it
    found it, also when SIGTERM ends it (exit 143); a dead run's folder is removed by it."""
    import vae_ddp.studies.compare as compare
    from vae_ddp.cli import Terminated, main_captured

    tmp = Path(tempfile.mkdtemp(prefix="t36-", dir="/tmp"))  # short: a forkserver socket's path is in it
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    (tmp / "vae-ddp-run-999999999").mkdir()  # a run killed by SIGKILL (no such PID)
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    launched = _workers_and_inductor
    if ending == "SIGTERM":
        def launched(*args, **kwargs):
            _workers_and_inductor(*args, **kwargs)
            raise Terminated()
    monkeypatch.setattr(compare, "launch_by_world_size", launched)
    code, _, err = main_captured(["compare", "--configs", "[single]", "--steps", "2", "--out", str(tmp_path / "o")])
    assert code == (0 if ending == "exit 0" else 143), err
    assert list(tmp.iterdir()) == []


def _inductor_cache_name() -> str:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(default_cache_dir()).name  # torch's own rule: torchinductor_USER


@pytest.mark.timeout(300)
@pytest.mark.parametrize("before", ["nothing", "a cache"])
def test_an_audit_leaves_tmpdir_as_it_found_it(tmp_path, request, before):
    """``vae-ddp audit`` left an empty ``torchinductor_root/`` in TMPDIR (importing Lightning makes inductor's
    default cache folder, and names it in ``TORCHINDUCTOR_CACHE_DIR``, which the runs inherited): TMPDIR is as
    the command found it; an inductor cache that existed before is left as it was, its files untouched."""
    import os
    import subprocess
    import sys

    from helpers import ROOT

    tmp = Path(tempfile.mkdtemp(prefix="t59-", dir="/tmp"))  # short: a forkserver socket's path is in it
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    if before == "a cache":
        (tmp / _inductor_cache_name() / "kept").mkdir(parents=True)
    found = sorted(p.relative_to(tmp) for p in tmp.rglob("*"))
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"} | {"TMPDIR": str(tmp)}
    proc = subprocess.run([sys.executable, "-m", "vae_ddp.cli", "audit", "--model", "examples.audit_models.Plain",
                           "--data", "examples.audit_models.Regression", "--steps", "2", "--effect_batches", "0",
                           "--out", str(tmp_path / "o")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.relative_to(tmp) for p in tmp.rglob("*")) == found


def _children(pid: int) -> list[int]:
    """The PIDs of ``pid``'s child processes (``/proc/PID/task/*/children``)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


@pytest.mark.parametrize("api", [False, True], ids=["private_tmpdir", "audit API's folder"])
def test_a_sigkill_leaves_no_run_folder_behind(tmp_path, api):
    """SIGKILL of a process inside ``private_tmpdir`` before it started anything else (no guard or zygote to
    outlive it): its reaper removes the run folder, the API's temporary output folder in it, and the empty
    folders ``also_if_empty`` names (one that is not empty stays). Before, the folder stayed until the next run.
    Waited for on the reaper's end (a pidfd), not by sleeping."""
    import os
    import select
    import signal
    import subprocess
    import sys

    tmp = Path(tempfile.mkdtemp(prefix="t59r-", dir="/tmp"))
    try:
        empty, full = tmp / "made-empty", tmp / "made-full"
        empty.mkdir()
        full.mkdir()
        (full / "kept").write_text("the user's")
        inner = "tempfile.mkdtemp(prefix='vae-ddp-audit-')" if api else "'-'"
        script = ("import signal, tempfile\nfrom vae_ddp.utils import private_tmpdir\n"  # waits for its SIGKILL
                  f"with private_tmpdir(({str(empty)!r}, {str(full)!r})) as p:\n"
                  f"    print(p, {inner}, flush=True)\n    signal.pause()\n")
        env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
        top = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
        try:
            folder, made = top.stdout.readline().split()
            assert Path(folder).parent == tmp and (made == "-" or Path(made).parent == Path(folder))
            reapers = _children(top.pid)
            assert len(reapers) == 1, f"{len(reapers)} child processes, not one reaper"
            pidfd = os.pidfd_open(reapers[0])
            os.kill(top.pid, signal.SIGKILL)
            assert select.select([pidfd], [], [], 20)[0], "the reaper did not end within 20 s of the SIGKILL"
            os.close(pidfd)
        finally:
            top.kill()
            top.wait(timeout=30)
        assert sorted(p.name for p in tmp.iterdir()) == ["made-full"]
        assert (full / "kept").exists()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_threads_share_the_run_folder_and_the_last_removes_it(tmp_path, monkeypatch):
    """Two threads in ``private_tmpdir`` at once (two API calls of one process): the second uses the first's
    folder, which stays while either is in it, and TMPDIR comes back when the last one leaves."""
    import os
    import threading

    from vae_ddp.utils import private_tmpdir

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def second() -> None:
        first_in.wait(30)
        with private_tmpdir() as folder:
            seen["second"] = folder
            second_in.set()
            first_out.wait(30)
            seen["after first left"] = folder.is_dir() and os.environ["TMPDIR"] == str(folder)

    t = threading.Thread(target=second)
    t.start()
    with private_tmpdir() as folder:
        seen["first"] = folder
        first_in.set()
        assert second_in.wait(30)
    first_out.set()
    t.join(30)
    assert seen["second"] == seen["first"] and seen["after first left"], seen
    assert not seen["first"].exists() and os.environ["TMPDIR"] == str(tmp_path)
    assert list(tmp_path.iterdir()) == []


_LEAVES = {  # how a caller leaves its run folder: the docs runner's end_all, or the command's main
    "end_all": ("with private_tmpdir() as p:\n"
                "    z = zygote._zygote('slow_import', wait=False)\n"
                "    print(p, z.proc.pid, flush=True)\n"
                "    zygote.end_all()\n"),
    "vae-ddp": ("import sys\nfrom vae_ddp import cli\nZ = []\n"
                "def started(argv=None):  # the command's work: a zygote still importing when it ends\n"
                "    Z.append(zygote._zygote('slow_import', wait=False))\n"
                "    print(os.environ['TMPDIR'], Z[0].proc.pid, flush=True)\n    return 0\n"
                "cli.main, cli._leave, sys.argv = started, lambda code: None, ['vae-ddp', '-h']\n"
                "cli.entry()\nz = Z[0]\n"),
}


@pytest.mark.parametrize("leave", list(_LEAVES))
def test_a_zygote_still_importing_does_not_make_the_removed_folder_again(tmp_path, leave):
    """A caller that leaves its run folder while its zygote still imports (the docs runner or the ``vae-ddp``
    command interrupted at once) ends the zygote first (``zygote.end_all``): the zygote's imports wrote into ``TMPDIR``
    (inductor's cache folder) after the folder had been removed, and made it again. Here the module the zygote
    imports writes into ``TMPDIR`` once the caller has left the folder; the zygote is gone and the folder stays
    removed (a zygote left alive is given 30 s to write)."""
    import os
    import subprocess
    import sys

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "slow_import.py").write_text(
        "import os, pathlib, time\nleft = pathlib.Path(os.environ['T59_LEFT'])\n"
        "while not left.exists():  # the caller has left its run folder\n    time.sleep(0.05)\n"
        "pathlib.Path(os.environ['TMPDIR'], 'torchinductor').mkdir(parents=True, exist_ok=True)\n"
        "pathlib.Path(left.parent, 'wrote').touch()\n")
    (tmp_path / "tmp").mkdir()
    script = ("import os, pathlib, time\nfrom vae_ddp import zygote\nfrom vae_ddp.utils import private_tmpdir\n"
              + _LEAVES[leave] +
              "pathlib.Path(os.environ['T59_LEFT']).touch()\n"
              "t, wrote = time.monotonic(), pathlib.Path(os.environ['T59_LEFT']).with_name('wrote')\n"
              "while z.proc.poll() is None and not wrote.exists() and time.monotonic() - t < 30:\n"
              "    time.sleep(0.05)\n")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"), PYTHONPATH=f"{src}:{tmp_path / 'lib'}",
               T59_LEFT=str(tmp_path / "left"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    folder, pid = done.stdout.split()
    assert Path(folder).parent == tmp_path / "tmp"
    assert not Path(folder).exists(), sorted(p.name for p in Path(folder).rglob("*"))
    assert not Path(f"/proc/{pid}").exists(), "the zygote outlived its caller's folder"


@pytest.mark.timeout(180)
def test_a_sigkill_while_the_command_imports_leaves_nothing(tmp_path):
    """``vae-ddp audit`` SIGKILLed while it imports torch and Lightning, once the imports made inductor's cache
    folder: the imports run inside the command's run folder, which its reaper removes (the folder was made in
    TMPDIR itself, and a SIGKILL before the command's end left it there: the 30 kills, seed 29)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["TMPDIR"] = str(tmp)
    vae_ddp = Path(sys.executable).with_name("vae-ddp")
    top = subprocess.Popen([str(vae_ddp), "audit", "--model", "examples/audit_models.py:Plain", "--data",
                            "examples/audit_models.py:Regression", "--out", str(tmp_path / "out")],
                           cwd=Path(__file__).resolve().parents[1], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        t = time.monotonic()
        while not list(tmp.rglob("torchinductor*")) and top.poll() is None and time.monotonic() - t < 120:
            time.sleep(0.02)
        made = [str(p.relative_to(tmp)) for p in tmp.rglob("torchinductor*")]
        assert made, "the imports made no inductor folder"
        os.kill(top.pid, signal.SIGKILL)
    finally:
        top.kill()
        top.wait(timeout=30)
    t = time.monotonic()
    while list(tmp.iterdir()) and time.monotonic() - t < 30:
        time.sleep(0.05)
    assert list(tmp.iterdir()) == [], (made, sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*")))
