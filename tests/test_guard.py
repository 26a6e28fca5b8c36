"""Every launch ends: the guard's watchdog, the end of the whole tree, and no orphans
(``vae_ddp.guard``); DataLoader workers that cannot inherit a held lock (``vae_ddp.workers``)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from vae_ddp import guard
from vae_ddp.harness.launch import Job, RunFailed, launch
from helpers import ROOT


def alive(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line or stderr's path contains ``marker``, this one
    excepted (a launch forked from a zygote keeps the zygote's command line; its stderr is the
    launch's log)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        with contextlib.suppress(OSError):
            cmdline += " " + os.readlink(d / "fd" / "2")
        if marker in cmdline and state not in ("Z", "X"):
            found.append(int(d.name))
    return found


def _not_leader(pid: int) -> bool:
    """Whether ``pid`` runs and does not lead its session (a guard does: ``os.setsid``)."""
    try:
        return os.getsid(pid) != pid
    except OSError:
        return False


def unique() -> str:
    """A marker no other test session's processes carry (tmp_path's name repeats across sessions)."""
    import uuid

    return uuid.uuid4().hex[:12]


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until every process of ``pids`` has ended (a zombie counts as ended); return those
    still running after ``timeout`` seconds. A pidfd turns readable when its process ends: an
    event, not a poll (the processes are not children of this one: ``waitpid`` cannot)."""
    fds = {}
    for pid in pids:
        try:
            fds[pid] = os.pidfd_open(pid)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    try:
        while fds and (left := deadline - time.monotonic()) > 0:
            ready = select.select(list(fds.values()), [], [], left)[0]
            for pid in [pid for pid, fd in fds.items() if fd in ready]:
                os.close(fds.pop(pid))
    finally:
        for fd in fds.values():
            os.close(fd)
    return list(fds)


def beats_in(directory: Path) -> int:
    """A descriptor that turns readable whenever a file in ``directory`` is created or touched
    (Linux inotify): the heartbeat files of a guard, so a test wakes at each rank's progress."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    # CREATE, ATTRIB, MODIFY
    if fd < 0 or libc.inotify_add_watch(fd, os.fsencode(directory), 0x100 | 0x004 | 0x002) < 0:
        raise OSError(ctypes.get_errno(), "inotify")
    return fd


def wait_for(predicate, events: int, timeout: float) -> bool:
    """``predicate()`` checked now and after each event on the descriptor ``events``, until it
    holds or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not predicate():
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([events], [], [], left)[0]:
            return predicate()
        os.read(events, 1 << 16)
    return True


STUCK = textwrap.dedent("""
    import signal, subprocess, sys
    from vae_ddp.guard import beat
    subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()", {marker!r}])  # a child of its own
    beat()
    def stuck_here():
        while True: signal.pause()  # noqa: E701  a hang: wakes only for signals, never ends by itself
    stuck_here()
""")


def test_watchdog_dumps_the_stacks_names_the_frame_and_ends_the_tree(tmp_path):
    marker = f"stuck-{unique()}"
    script = tmp_path / "stuck.py"
    script.write_text(STUCK.format(marker=marker))
    # ended by its watchdog (STALLED), not by the timeout (which raises TimeoutExpired)
    proc = guard.run([sys.executable, str(script)], stall=3, capture_output=True, text=True, timeout=120)
    assert proc.returncode == guard.STALLED, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("vae-ddp guard: no process made progress for 3 s"), last
    assert "rank 0 in stuck_here (" in last and "stuck.py:7)" in last, last
    assert 'in stuck_here' in proc.stderr and "--- rank 0 (pid" in proc.stderr  # the dumped stacks
    assert not wait_gone(alive(marker) + alive(str(script)), 5), "a process outlived the guard"


NESTED = textwrap.dedent("""
    import sys
    from vae_ddp import guard
    guard.beat()  # this process dumps its stacks on SIGUSR1 (as a results entry does before its launch)
    proc = guard.run([sys.executable, sys.argv[1]], how="fork", stall=3, capture_output=True, text=True, timeout=120)
    print(proc.returncode, proc.stderr.strip().splitlines()[-1])
""")


def test_a_forked_command_of_a_process_that_beat_still_dumps_its_stacks(tmp_path):
    """A fork inherits faulthandler's record of its caller's SIGUSR1 handler but gets the
    guard's default one: the command's first beat registers it again, so the watchdog's SIGUSR1
    dumps its stacks instead of ending it (seen: "no stacks: not responding" in every nested launch)."""
    marker = f"nested-{unique()}"
    stuck, nested = tmp_path / "stuck.py", tmp_path / "nested.py"
    stuck.write_text(STUCK.format(marker=marker))
    nested.write_text(NESTED)
    proc = guard.run([sys.executable, str(nested), str(stuck)], stall=60, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"{guard.STALLED} vae-ddp guard: no process made progress"), proc.stdout
    assert "rank 0 in stuck_here (" in proc.stdout, proc.stdout
    assert not wait_gone(alive(marker), 5), "a process outlived the guard"


@pytest.mark.parametrize("cmd", [["-c", "pass"], ["-u", "x.py"], ["-m"], []])
def test_a_forked_command_is_a_script_or_a_module(cmd):
    """``how="fork"`` runs what ``runpy`` runs: a script or ``-m MODULE``; anything else (and a
    stderr of ``subprocess.STDOUT``) is refused before any process starts."""
    with pytest.raises(ValueError, match="how='fork' runs"):
        guard.run([sys.executable, *cmd], how="fork")
    with pytest.raises(ValueError, match="how='fork' takes stdout and stderr"):
        guard.run([sys.executable, "x.py"], how="fork", stderr=subprocess.STDOUT)
    with pytest.raises(ValueError, match="how='spawn': use one of 'exec', 'fork', 'zygote'"):
        guard.run([sys.executable, "x.py"], how="spawn")  # type: ignore[arg-type]


def test_nothing_outlives_a_command_that_exits(tmp_path):
    """A command that leaves a process behind (a stray rank, a worker) has it ended."""
    marker = f"stray-{unique()}"
    code = ("import subprocess, sys; "
            f"subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()', {marker!r}])")
    proc = guard.run([sys.executable, "-c", code], timeout=60, grace=2)
    assert proc.returncode == 0
    assert not alive(marker)


def test_guard_ends_the_tree_when_its_parent_is_killed(tmp_path):
    """SIGKILL of the caller, which no handler sees: the guard notices and ends the tree."""
    marker = f"orphan-{unique()}"
    started = tmp_path / "started"
    os.mkfifo(started)  # the guarded command writes to it once it runs
    ready = os.open(started, os.O_RDONLY | os.O_NONBLOCK)
    command = "import signal, sys; open(sys.argv[1], 'w').write('x'); signal.pause()"
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from vae_ddp import guard
        guard.run([sys.executable, '-c', {command!r}, {str(started)!r}, {marker!r}])
    """)])
    try:
        assert select.select([ready], [], [], 60)[0] and os.read(ready, 1) == b"x", "the guarded command did not start"
        pids = alive(marker)
        assert pids
        parent.kill()
        parent.wait()
        assert not wait_gone(pids, 15) and not alive(marker), "the guarded command outlived its caller"
    finally:
        os.close(ready)
        parent.kill()


IN_FORK = textwrap.dedent("""
    import os, signal, subprocess, sys
    from vae_ddp import guard, zygote

    if __name__ == "__main__" and sys.argv[1] == "command":  # the command: python in_fork.py command HOW STARTED
        how, started = sys.argv[2:4]
        subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()", MARKER])  # a process of its own
        with open(started, "w") as f:
            f.write(" ".join(sys.argv[1:]) + " " + os.environ["SEEN"])
        if how == "raise":
            raise ValueError("the command failed on purpose")
        if how == "exit":
            sys.exit(7)
        signal.pause()  # "timeout", "killed": never ends by itself
    elif __name__ == "__main__":  # the caller: python in_fork.py HOW STARTED MARKER
        how, started = sys.argv[1:3]  # the marker is in the command line of every fork of this process
        env = dict(os.environ, SEEN="env-given")
        # MODE "zygote": the zygote imports this file as a module (the marker is its name) and runs it as -m
        cmd = [__file__] if MODE == "fork" else ["-m", MARKER]
        try:
            code = guard.run([sys.executable, *cmd, "command", how, started], how=MODE,
                             env=env, timeout=4 if how == "timeout" else None, grace=2).returncode
        except subprocess.TimeoutExpired:
            code = "timed out"
        print(code, flush=True)
""")


def in_fork(tmp_path: Path, marker: str, mode: str = "fork") -> Path:
    """The script of the forked-command tests; in ``mode`` "zygote" its name is ``marker`` (a
    zygote's forks carry the zygote's command line, which names the module)."""
    script = tmp_path / ("in_fork.py" if mode == "fork" else f"{marker}.py")
    script.write_text(f"MARKER = {marker!r}\nMODE = {mode!r}\n" + IN_FORK)
    return script


def marker_of(mode: str, name: str) -> str:
    """A marker for ``mode``'s processes: a module's name for a zygote's (no hyphen)."""
    return f"{name}-{unique()}" if mode == "fork" else f"z{unique()}"


@pytest.mark.parametrize("mode", ["fork", "zygote"])
@pytest.mark.parametrize("how, printed", [("exit", "7"), ("raise", "1"), ("timeout", "timed out")])
def test_a_command_forked_under_a_guard_ends_with_its_tree(tmp_path, how, printed, mode):
    """``guard.run(how="fork")``: the command is a fork of the caller that runs ``python ARGS`` with
    the ``argv`` and the environment it was given; its exit code (1 when it raised, with the
    traceback) comes back, and on exit or timeout nothing it started outlives it. The same with
    ``how="zygote"`` (a fork of the caller's zygote of the module, ``vae_ddp.zygote``)."""
    marker = marker_of(mode, "in-fork")
    script = in_fork(tmp_path, marker, mode)
    proc = subprocess.run([sys.executable, str(script), how, str(tmp_path / "started"), marker],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.stdout.strip() == printed, proc.stderr[-3000:]
    assert (tmp_path / "started").read_text() == f"command {how} {tmp_path / 'started'} env-given"
    assert ("ValueError: the command failed on purpose" in proc.stderr) == (how == "raise"), proc.stderr[-3000:]
    assert not wait_gone(alive(marker), 15) and not alive(marker), "a process outlived the forked command"


def caller_of_a_forked_command(tmp_path: Path, marker: str, mode: str = "fork") -> tuple[subprocess.Popen, int]:
    """A process whose forked command (under a forked guard) runs until it is killed, once the
    command has started; and the descriptor the command said so on (to close)."""
    script = in_fork(tmp_path, marker, mode)
    started = tmp_path / "started"
    os.mkfifo(started)
    ready = os.open(started, os.O_RDONLY | os.O_NONBLOCK)
    caller = subprocess.Popen([sys.executable, str(script), "killed", str(started), marker], cwd=tmp_path)
    if not (select.select([ready], [], [], 60)[0] and os.read(ready, 64).startswith(b"command")):
        caller.kill()
        os.close(ready)
        pytest.fail("the command did not start")
    return caller, ready


@pytest.mark.parametrize("mode", ["fork", "zygote"])
def test_a_command_forked_under_a_guard_ends_when_its_caller_is_killed(tmp_path, mode):
    """SIGKILL of the caller of ``guard.run(how="fork")``: the guard (its fork) ends the tree. With
    ``how="zygote"`` the zygote dies with its caller and its guard ends the tree."""
    marker = marker_of(mode, "in-fork-orphan")
    caller, ready = caller_of_a_forked_command(tmp_path, marker, mode)
    try:
        pids = alive(marker)
        assert len(pids) >= 3  # the guard, the command and the process it started
        caller.kill()
        caller.wait()
        assert not wait_gone(pids, 15) and not alive(marker), "the forked command outlived its caller"
    finally:
        os.close(ready)
        caller.kill()


@pytest.mark.parametrize("mode", ["fork", "zygote"])
def test_a_forked_command_dies_with_its_guard(tmp_path, mode):
    """A guard killed outright (``run_all`` sends SIGKILL to one that did not end its tree in time)
    takes its forked command with it (``PR_SET_PDEATHSIG``) instead of leaving it to init."""
    import psutil

    marker = marker_of(mode, "in-fork-guard-killed")
    caller, ready = caller_of_a_forked_command(tmp_path, marker, mode)
    try:
        (guard_process,) = psutil.Process(caller.pid).children()
        if mode == "zygote":  # the caller's child is its zygote, whose child is the guard
            (guard_process,) = guard_process.children()
        command = [p.pid for p in guard_process.children() if p.cmdline() == guard_process.cmdline()]
        assert len(command) == 1, command
        guard_process.kill()
        assert not wait_gone(command, 10), "the command outlived its guard"
    finally:
        os.close(ready)
        caller.kill()
        caller.wait()
        for pid in alive(marker):  # the process the command started (its guard, the subreaper, is gone)
            os.kill(pid, signal.SIGKILL)


def test_a_guard_whose_caller_died_while_it_started_runs_nothing(tmp_path):
    """The caller passes its pid (``--parent``): a guard whose caller died before the guard read
    its own parent (Python's start-up under load is a second or more) ends at once instead of
    taking init or a subreaper for its parent and running the command forever (seen in CI: the
    parent-killed test's guard outlived it with ``ppid`` 1)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    flag, tmp = tmp_path / "ran", tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run([sys.executable, "-m", "vae_ddp.guard", "--parent", str(gone.pid), "--",
                           sys.executable, "-c", f"open({str(flag)!r}, 'w')"], timeout=60,
                          env=dict(os.environ, TMPDIR=str(tmp)))
    assert proc.returncode == 128 + signal.SIGTERM and not flag.exists()
    assert not list(tmp.iterdir())  # nor does it leave its folder behind
    assert f"--parent {os.getpid()} " in " ".join(guard.guarded(["true"]))


def test_launch_fails_with_the_watchdogs_line(tmp_path):
    """A study run that hangs fails in ``stall`` seconds with one line, never at a CI limit."""
    from vae_ddp.harness.configs import RunSpec

    spec = RunSpec(config="single", steps=1).validate()
    stuck = [sys.executable, "-c", "import signal\nfrom vae_ddp.guard import beat\nbeat()\nwhile True: signal.pause()"]
    with pytest.raises(RunFailed, match=r"^run 'single': no process made progress for 2 s .*rank 0 in <module>"):
        launch(Job({"single": [spec]}), tmp_path / "run", quiet=True, entry=stuck, stall=2)


def test_a_launch_passes_its_spec_in_a_file_not_on_the_command_line(tmp_path):
    """The child of a launch gets the path of ``OUT_DIR/job.json`` (the job's JSON), not the JSON:
    a command line is what ``ps`` shows, and a group's specs are kilobytes."""
    import json

    from vae_ddp.harness.configs import RunSpec

    job = Job({"single": [RunSpec(config="single", steps=1).validate()]})
    child = [sys.executable, "-c", "import json, pathlib, sys\n"
             "out = pathlib.Path(sys.argv[2])\n"
             "(out / 'run.json').write_text(json.dumps({'argv': sys.argv[1:], "
             "'job': json.loads(pathlib.Path(sys.argv[1]).read_text())}))"]
    got = launch(job, tmp_path / "run", quiet=True, entry=child)
    assert got["argv"] == [str(tmp_path / "run" / "job.json"), str(tmp_path / "run")]
    assert got["job"] == json.loads(job.to_json())


HUNG_RANK = textwrap.dedent("""
    import signal, sys
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            if self.global_step == 2 and self.global_rank == 1:
                while True: signal.pause()  # noqa: E701  rank 1 hangs; rank 0 waits for it in the all-reduce
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    from vae_ddp import heartbeat  # a script's own Trainer under a guard: its heartbeat, asked for

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=6, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                         callbacks=heartbeat.callbacks())
    trainer.fit(Net(), DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4))
""")


def test_a_hung_ddp_rank_is_named_with_its_frame(tmp_path):
    """Real Lightning DDP (2 gloo ranks): the heartbeat (``callbacks=heartbeat.callbacks()``) reaches
    the guard, whose watchdog names the hung rank and the frame it is stuck in."""
    script = tmp_path / "hung_rank.py"
    script.write_text(HUNG_RANK)
    proc = guard.run([sys.executable, str(script)], stall=10, startup=300, capture_output=True, text=True,
                     timeout=400, cwd=tmp_path)
    assert proc.returncode == guard.STALLED, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "rank 1 in training_step (" in last and "hung_rank.py:14)" in last, last
    assert "rank 0 in " in last, last
    assert not alive(str(script))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_no_process_of_an_audit_outlives_its_top_process(tmp_path, sig):
    """A 2-rank audit, its top ``vae-ddp`` process ended mid-run by TERM, INT or KILL (what
    ``subprocess.run(timeout=...)`` sends): 15 s later no process of the launch is alive; TERM
    and INT are said in the last line (``vae-ddp: terminated``, exit 143; ``interrupted``, 130) and
    the output folder's lock is gone with the run. The run's own temporary folder goes too, after KILL as
    well (its reaper, ``utils.private_tmpdir``, removes it: nothing is left in TMPDIR)."""
    import shutil
    import tempfile

    from vae_ddp.utils import LOCK_NAME, RUN_TMP

    out, beats = tmp_path / "audit", tmp_path / "beats"
    tmp = Path(tempfile.mkdtemp(prefix="t59k-", dir="/tmp"))  # short: a forkserver socket's path is in it
    stderr = open(tmp_path / "stderr.txt", "w")
    beats.mkdir()
    events = beats_in(beats)
    # this test as the outer guard (its heartbeat folder): the audit's guard passes its runs' beats on to it
    env = dict(os.environ, VAE_DDP_HEARTBEAT_DIR=str(beats), TMPDIR=str(tmp))
    # Ctrl-C as a terminal delivers it: a background job of a shell without job control (`cmd &` in a
    # script) starts with SIGINT ignored, and Python leaves it ignored in the processes it starts
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        top = subprocess.Popen([sys.executable, "-m", "vae_ddp.cli", "audit", "--model", "examples.audit_models.Plain",
                                "--data", "examples.audit_models.Regression", "--steps", "30", "--out", str(out)],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        def ranks() -> list[int]:  # the launch's processes (not its guard, a session's leader): 2 ranks, one device's
            return [p for p in alive(str(out / "runs")) if _not_leader(p)]

        assert wait_for(lambda: len(ranks()) >= 3, events, 300), "the audit's DDP ranks did not start"
        assert alive(str(out))

        def names() -> set[str]:  # what ps -eo comm shows of the launch's processes
            found = set()
            for pid in alive(str(out)):
                with contextlib.suppress(OSError):
                    found.add(Path(f"/proc/{pid}/comm").read_text().strip())
            return found

        wanted = {"vae-ddp guard", "vae-ddp rank 0", "vae-ddp rank 1", "vae-ddp single"}
        assert wait_for(lambda: wanted <= names(), events, 120), f"ps -eo comm shows {names()}, not {wanted}"
        os.kill(top.pid, sig)
        top.wait(timeout=60)
        left = wait_gone(alive(str(out)), 15)
        assert not left and not alive(str(out)), f"left running after {sig.name}: {alive(str(out))}"
        said = (tmp_path / "stderr.txt").read_text().strip().splitlines()
        if sig != signal.SIGKILL:  # a killed process says nothing; its lock is taken over by the next run
            assert top.returncode == {signal.SIGTERM: 143, signal.SIGINT: 130}[sig], (top.returncode, said[-3:])
            assert said and ("terminated" if sig == signal.SIGTERM else "interrupted") in said[-1], said[-3:]
            assert not (out / LOCK_NAME).exists()
        assert not list(tmp.glob(f"{RUN_TMP}*")), sorted(p.name for p in tmp.rglob("*"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        stderr.close()
        os.close(events)
        top.kill()
        for pid in alive(str(out)):
            os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------- workers
def test_loaders_with_workers_start_them_from_a_forkserver():
    import torch
    from torch.utils.data import DataLoader, Subset, TensorDataset

    from vae_ddp.data import DigitsDataModule
    from vae_ddp.workers import make_fork_safe

    dm = DigitsDataModule(batch_size=8, num_workers=1, max_samples=40)
    dm.setup()
    for dl in (dm.train_dataloader(), dm.val_dataloader()):
        assert dl.multiprocessing_context.get_start_method() == "forkserver"

    ds = Subset(TensorDataset(torch.arange(12.0)), list(range(8)))
    mine = DataLoader(ds, batch_size=4, num_workers=1)
    note = make_fork_safe(mine)
    assert mine.multiprocessing_context.get_start_method() == "forkserver"
    assert [b[0].tolist() for b in mine] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    assert note is None or "forkserver" in note
    theirs = DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context="spawn")
    assert make_fork_safe(theirs) is None and theirs.multiprocessing_context.get_start_method() == "spawn"
    none = DataLoader(ds, batch_size=4)
    assert make_fork_safe(none) is None and none.multiprocessing_context is None


def test_a_guard_inside_a_guard_passes_the_heartbeat_on(tmp_path):
    """A study launched by a docs example runs under two guards: the outer one sees the runs'
    progress through the inner one, so a run longer than the stall limit is not ended. The
    command beats once per line the test writes; the test writes the next line when the beat
    has reached the outermost guard's folder (inotify), until twice the stall limit has passed."""
    stall = 2.0
    go = tmp_path / "go"
    os.mkfifo(go)
    beats = tmp_path / "beats.py"
    beats.write_text("import sys\nfrom vae_ddp.guard import beat\nfor _ in open(sys.argv[1]):\n    beat()\n")
    outer = tmp_path / "outer.py"
    outer.write_text("import sys\nfrom vae_ddp import guard\n"
                     f"sys.exit(guard.run([sys.executable, {str(beats)!r}, {str(go)!r}], stall={stall}, "
                     "startup=60).returncode)\n")
    seen = tmp_path / "seen"  # the outermost guard passes its beats on here, as to a guard above it
    seen.mkdir()
    events = beats_in(seen)
    newest = lambda: max((f.stat().st_mtime_ns for f in seen.iterdir()), default=0)  # noqa: E731
    writer = os.open(go, os.O_RDWR)  # never blocks; the command reads until it is closed
    proc = subprocess.Popen(guard.guarded([sys.executable, str(outer)], stall=stall, startup=60, timeout=120),
                            env=dict(os.environ, VAE_DDP_HEARTBEAT_DIR=str(seen)), stderr=subprocess.PIPE, text=True)
    try:
        t0, rounds = time.monotonic(), 0
        while time.monotonic() - t0 < 2 * stall or rounds < 3:
            before = newest()
            os.write(writer, b"beat\n")
            assert wait_for(lambda: newest() > before, events, 60), "a beat did not reach the outermost guard"
            rounds += 1
    finally:
        os.close(writer)  # end of the lines: the command ends
        os.close(events)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]


def _python(text: str):
    """``text`` parsed as Python, or None when it is prose (a docstring)."""
    import ast

    try:
        return ast.parse(text)
    except SyntaxError:
        return None


def test_the_project_forks_in_one_place():
    """``os.fork()`` is called once in the project's code (src/, tools/, benchmarks/, examples/,
    tests/): in ``vae_ddp.forking.fork``; every other fork goes through it."""
    import ast

    calls = []
    for folder in ("src", "tools", "benchmarks", "examples", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            scripts = [n.value for n in ast.walk(tree)  # the scripts tests write and run
                       if isinstance(n, ast.Constant) and isinstance(n.value, str) and "os.fork" in n.value]
            for t in (tree, *filter(None, map(_python, scripts))):
                calls += [f"{path.relative_to(ROOT)}:{n.lineno}" for n in ast.walk(t)
                          if isinstance(n, ast.Call) and ast.unparse(n.func) in ("os.fork", "os.forkpty")]
    assert len(calls) == 1 and calls[0].startswith("src/vae_ddp/forking.py:"), calls


def test_a_spawned_pool_ends_with_its_parent(tmp_path):
    """``forking.spawned_map`` (the long-horizon runs' pool): its workers, busy in a task, end when
    the process that started them is killed (SIGKILL: nothing of it runs), and so does
    multiprocessing's resource tracker."""
    import psutil

    fifo = tmp_path / "started"
    os.mkfifo(fifo)
    ready = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # (a writer of its own: no end of file before the tasks)
    task = f"import os, signal; os.write(os.open({str(fifo)!r}, os.O_WRONLY), b'x'); signal.pause()"  # busy for good
    code = f"from vae_ddp.forking import spawned_map; list(spawned_map(exec, [({task!r},)] * 2, 2))"
    top = psutil.Popen([sys.executable, "-c", code], cwd=ROOT)
    try:
        started = b""
        while len(started) < 2 and select.select([ready], [], [], 120)[0]:  # each task says it runs
            started += os.read(ready, 2)
        assert started == b"xx", [p.cmdline() for p in top.children(recursive=True)]
        every = top.children(recursive=True)
        assert len([p for p in every if "spawn_main" in " ".join(p.cmdline())]) == 2  # the workers
    finally:
        top.kill()
        top.wait()
        os.close(ready)
    assert not psutil.wait_procs(every, timeout=20)[1], "a process of the pool outlived its parent"


WAITS_FOR_GO = textwrap.dedent("""
    import os, sys
    name, started, go = sys.argv[1:4]
    os.write(os.open(started, os.O_WRONLY), name.encode())  # this command runs
    os.read(os.open(go, os.O_RDONLY), 1)  # until the test says go
""")


def test_a_zygote_serves_on_when_the_thread_that_started_it_ends(tmp_path):
    """A zygote started by one thread of its caller (``guard.run(how="zygote")`` in a thread: the
    docs' runner with ``VAE_DDP_DOCS_JOBS=2``) goes on serving the others once that thread ended.
    ``PR_SET_PDEATHSIG`` fires when the starting *thread* ends: with it, the other thread's command,
    running meanwhile, was killed (exit -9; found by trying two docs entries at once)."""
    import threading

    script = tmp_path / "waits_for_go.py"
    script.write_text(WAITS_FOR_GO)
    fifos = {name: tmp_path / name for name in ("started", "go_a", "go_b")}
    for f in fifos.values():
        os.mkfifo(f)
    fds = {name: os.open(f, os.O_RDWR | os.O_NONBLOCK) for name, f in fifos.items()}  # never blocks a writer
    done: dict = {}

    def run(name: str) -> None:
        done[name] = guard.run([sys.executable, str(script), name, str(fifos["started"]), str(fifos[f"go_{name}"])],
                               how="zygote", preload=("colorsys",), timeout=120, grace=2)

    def runs(name: str) -> None:  # the command has said it runs
        assert select.select([fds["started"]], [], [], 120)[0] and os.read(fds["started"], 1) == name.encode()

    first, second = threading.Thread(target=run, args=("a",)), threading.Thread(target=run, args=("b",))
    try:
        first.start()  # starts the zygote
        runs("a")
        second.start()  # a command of the same zygote
        runs("b")
        os.write(fds["go_a"], b"x")
        first.join(120)  # the zygote's starting thread has ended, the second command still runs
        os.write(fds["go_b"], b"x")
        second.join(120)
    finally:
        for fd in fds.values():
            os.close(fd)
    assert done["a"].returncode == 0 and done["b"].returncode == 0, {k: v.returncode for k, v in done.items()}


STOPPED = textwrap.dedent("""
    import os, signal, sys, time
    from vae_ddp.beats import beat
    from vae_ddp.forking import fork
    def rank(r):
        for i in range(10 ** 6):
            if r == 0 and i > 3 and sys.argv[1] == "waits":
                signal.pause()  # rank 0 waits for rank 1 without a beat (in a collective, say)
            beat(r, i)
            if r == 1 and i == 3:
                os.kill(os.getpid(), signal.SIGSTOP)  # rank 1 stops; rank 0 goes on beating, or waits
            time.sleep(0.1)
    def done():  # one device's runs beside the ranks, already ended when rank 1 stops
        os.environ["VAE_DDP_ROLE"] = "one device's process"
        beat(0, 0)
    beside = fork(done)
    child = fork(lambda: rank(1))
    rank(0)
""")


@pytest.mark.parametrize("others", ["beat", "waits"])
def test_a_stopped_rank_is_named_and_ended_while_others_beat(tmp_path, others):
    """A rank stopped with SIGSTOP while another process goes on beating (the audit's one-device runs
    beside its ranks): it was ended after 95 s with the watchdog at 30, named 'rank 1 in an unknown
    frame'. Now within the watchdog's seconds, named as the stopped one; also when the others wait
    for it without a beat (the whole tree stalls)."""
    script = tmp_path / "stopped.py"
    script.write_text(STOPPED)
    t0 = time.monotonic()
    proc = guard.run([sys.executable, str(script), others], stall=2, capture_output=True, text=True, timeout=30)
    took = time.monotonic() - t0
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == guard.STALLED, (proc.returncode, proc.stderr[-3000:])
    why = "a process was stopped for 2 s" if others == "beat" else "no process made progress for 2 s"
    assert last.startswith(f"vae-ddp guard: {why} in "), last
    assert "; rank 1 (PID " in last and ") is stopped (SIGSTOP), not running; " in last, last
    # each process named once, by its role: the stopped one as stopped (no frame claimed for it), an ended one not
    assert last.count("rank 1") == 1 and "one device" not in last, last
    if others == "beat":
        assert last.count("rank 0 in ") == 1, last
    assert took < 20 and not alive(str(script)), took
