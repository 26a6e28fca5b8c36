"""Bad input: one line on stderr saying what is wrong and what to do, exit code 2, no traceback,
before any training starts (no output folder is written)."""

import os
import pytest
import torch

from conftest import run_cli
from vae_ddp.cli import main
from helpers import ROOT


def _run(capsys, *args):
    code = main(list(args))
    return code, capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--global_batch_size", "255", "--devices", "2"], "global batch size 255 is not divisible by 2 devices"),
    (["--data", "imagefolder", "--data_dir", "/nonexistent/cifar"], "--data_dir /nonexistent/cifar does not exist"),
    (["--configs", "[single, fsdp]"], "unknown --configs 'fsdp': use one of single, ddp, dp"),
    (["--model", "resnet999"], "unknown --model 'resnet999': use one of resnet18, small"),
    (["--data", "mnist"], "unknown --data 'mnist': use one of digits, cifar10, imagefolder"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--steps", "ten"], "--steps: expected int, got 'ten'"),
    (["--exact"], "--exact: expected a value (true or false for a switch)"),
    (["--global-batch-size", "64"], "unrecognized arguments: --global-batch-size 64 (flags are the Python names, "
                                    "with underscores: --global_batch_size"),
    (["--configs", "single", "ddp"], "--configs: expected list, got 'single' (write a list as '[a, b]'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    # the hint names the flag the user typed, in underscores (it named --global_batch_size for any)
    (["--data-dir", "/tmp"], "unrecognized arguments: --data-dir /tmp (flags are the Python names, with underscores: "
                             "--data_dir; see -h)"),
    (["--config", "/nonexistent/c.yaml"], "--config: File does not exist"),
])
def test_bad_input_is_one_clear_line(args, message, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = _run(capsys, "compare", "--out", str(out), *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vae-ddp: error: ") and message in lines[0]
    assert not out.exists()


def test_empty_data_dir_names_the_path_and_the_data(tmp_path, capsys):
    (tmp_path / "empty" / "cat").mkdir(parents=True)
    (tmp_path / "empty" / "cat" / "notes.txt").write_text("no images here")
    code, err = _run(capsys, "compare", "--data", "imagefolder", "--data_dir", str(tmp_path / "empty"))
    assert code == 2
    assert f"{tmp_path / 'empty'} holds no images" in err
    assert "cifar10-jpg-subset" in err  # says where to get data


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has 2 CUDA devices: real DP can run")
def test_real_dp_without_two_cuda_devices_says_which_one_runs(tmp_path):
    """Through the installed console entry point: exit code and stderr as a user sees them."""
    proc = run_cli("compare", "--configs", "[dp]", "--dp_mode", "real", "--out", str(tmp_path / "o"), timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1
    assert "--dp_mode real needs 2 CUDA devices" in proc.stderr and "--dp_mode emulate" in proc.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, message", [
    (["--lr", "-1"], "--lr must be positive"),
    (["--val_every", "-1"], "--val_every must be 0"),
    (["--max_samples", "3", "--global_batch_size", "4"], "--max_samples 3 is too small"),
    (["--data", "imagefolder", "--data_dir", "/etc/passwd"], "is a file, not a folder"),
])
def test_more_bad_input(args, message, tmp_path, capsys):
    code, err = _run(capsys, "compare", "--out", str(tmp_path / "o"), *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_equivalence_world_size_zero_names_its_flag(tmp_path, capsys):
    code, err = _run(capsys, "equivalence", "--world_sizes", "[2, 0]", "--out", str(tmp_path / "o"))
    assert code == 2 and err.strip() == "vae-ddp: error: --world_sizes must be positive integers, got [2, 0]"
    assert not (tmp_path / "o").exists()


def test_unwritable_out_is_found_before_training(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "runs"
    code, err = _run(capsys, "compare", "--steps", "1", "--out", str(out))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"--out {out} is not writable" in err
    code, err = _run(capsys, "compare", "--out", str(tmp_path / "a-file"))
    assert code == 2 and "is a file, not a folder" in err


@pytest.mark.parametrize("spelling", [["--out", ""], ["--out="], ["--out", " "]])
@pytest.mark.parametrize("command", [["compare", "--steps", "1"],
                                     ["audit", "--model", f"{ROOT}/examples/audit_models.py:Plain",
                                      "--data", f"{ROOT}/examples/audit_models.py:Regression"]])
def test_an_empty_out_is_refused_not_read_as_the_working_folder(tmp_path, capsys, monkeypatch, command, spelling):
    """``Path("")`` is the working folder: an empty ``--out`` would write the results there."""
    monkeypatch.chdir(tmp_path)
    code, err = _run(capsys, *command, *spelling)
    prog = "vae-ddp audit" if command[0] == "audit" else "vae-ddp"
    assert code == 2 and err.strip() == f"{prog}: error: --out is empty: give it a value (see -h)", err
    assert not list(tmp_path.iterdir())


def test_a_valid_out_is_left_as_it_was_after_bad_input(tmp_path, capsys):
    out = tmp_path / "new" / "deeper"
    code, _ = _run(capsys, "compare", "--out", str(out), "--configs", "[dp]", "--dp_mode", "real", "--devices", "3")
    assert code == 2 and not (tmp_path / "new").exists()


def test_an_unreadable_image_is_named(tmp_path, capsys, monkeypatch):
    from torchvision.io import write_png

    monkeypatch.setenv("VAE_DDP_CACHE", str(tmp_path / "cache"))
    for c in ("cat", "dog"):
        (tmp_path / "imgs" / c).mkdir(parents=True)
        for i in range(3):
            write_png(torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8), str(tmp_path / "imgs" / c / f"{i}.png"))
    bad = tmp_path / "imgs" / "dog" / "broken.jpg"
    bad.write_bytes(b"\xff\xd8 not really a jpeg")
    code, err = _run(capsys, "compare", "--data", "imagefolder", "--data_dir", str(tmp_path / "imgs"),
                     "--out", str(tmp_path / "o"))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"cannot read image {bad}" in err and "remove or replace that file" in err
    assert not (tmp_path / "o").exists()


def test_cifar10_without_network_says_how_to_get_it(tmp_path, capsys, monkeypatch):
    import urllib.error
    import urllib.request

    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    code, err = _run(capsys, "compare", "--data", "cifar10", "--data_dir", str(tmp_path / "cifar"),
                     "--out", str(tmp_path / "o"))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "could not get CIFAR-10" in err and "cifar-10-python.tar.gz" in err and "--data imagefolder" in err
    assert not (tmp_path / "o").exists()


def test_lightningcli_example_with_a_missing_data_folder(tmp_path):
    import sys

    from vae_ddp import guard

    root = ROOT
    proc = guard.run([sys.executable, str(root / "examples" / "vae.py"), "fit", "--data.data_dir",
                      str(tmp_path / "missing")], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and errors[0].startswith(
        f"vae.py: error: --data.data_dir {tmp_path / 'missing'} does not exist: point it at an ImageFolder tree")


def test_the_library_raises_plain_exceptions_that_name_the_argument(tmp_path):
    """``vae_ddp.data`` is called from Python: its errors name ``data_dir``, not a flag, and are
    the built-in exceptions; only the command lines spell them as flags (above)."""
    from vae_ddp.data import ImageFolderDataModule, find_image_root, make_datamodule
    from vae_ddp.errors import UserError, input_error

    (tmp_path / "empty" / "cat").mkdir(parents=True)
    (tmp_path / "a-file").write_text("")
    cases = [
        (lambda: ImageFolderDataModule(str(tmp_path / "missing")), FileNotFoundError, "data_dir .* does not exist"),
        (lambda: find_image_root(tmp_path / "a-file"), NotADirectoryError, "data_dir .* is a file, not a folder"),
        (lambda: make_datamodule("imagefolder", str(tmp_path / "empty")), ValueError, "data_dir .* holds no images"),
        (lambda: make_datamodule("imagefolder"), ValueError, "data='imagefolder' needs data_dir"),
        (lambda: make_datamodule("mnist"), ValueError, "unknown data 'mnist'"),
    ]
    for call, kind, message in cases:
        with pytest.raises(kind, match=f"^{message}") as info:
            call()
        assert not isinstance(info.value, UserError) and "--" not in str(info.value)
        assert input_error(info.value) is info.value  # what the command lines turn into one line
    try:
        int("ten")  # a ValueError from elsewhere is a bug, not bad input: it keeps its traceback
    except ValueError as err:
        assert input_error(err) is None


def test_field_names_become_flags():
    from vae_ddp.harness.configs import in_flags

    assert in_flags("data_dir /tmp/data_dir/x does not exist") == "--data_dir /tmp/data_dir/x does not exist"
    assert in_flags("use data='imagefolder' with data_dir") == "use --data imagefolder with --data_dir"
    assert in_flags("out_dir runs/x is a file") == "--out runs/x is a file"
    assert in_flags("too few steps of data") == "too few steps of data"


def test_a_second_run_into_a_folder_in_use_is_refused_in_one_line(tmp_path, capsys):
    """One run per output folder: while a run holds --out (an flock the kernel releases when the run
    ends, however it ends), another `vae-ddp` into it is refused before any work, naming the run that
    holds it; the audit likewise. A lock file left behind without a live holder is taken over."""
    from vae_ddp.cli import main
    from vae_ddp.utils import LOCK_NAME, FolderInUse, out_folder_lock

    out = tmp_path / "out"
    with out_folder_lock(out, "vae-ddp compare --steps 2"):
        with pytest.raises(FolderInUse):
            with out_folder_lock(out, "another"):
                pass
        code = main(["compare", "--steps", "1", "--out", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err == [f"vae-ddp: error: --out {out} is in use by another run (PID {os.getpid()}: "
                                     "vae-ddp compare --steps 2): wait for it to end, or choose another --out"], err
        assert not (out / "results.json").exists()
    assert not (out / LOCK_NAME).exists()  # the run that held it removed it
    with out_folder_lock(tmp_path / "new" / "deeper", "writes nothing"):
        pass
    assert not (tmp_path / "new").exists()  # the folders the lock made, empty: removed with it
    out.mkdir()
    (out / LOCK_NAME).write_text('{"pid": 999999999, "command": "killed with -9"}')  # left by a killed run
    with out_folder_lock(out, "this one"):
        assert '"command": "this one"' in (out / LOCK_NAME).read_text()


@pytest.mark.parametrize("command", [["compare"], ["audit", "--model", "examples.audit_models.Plain", "--data",
                                                   "examples.audit_models.Regression"]], ids=["compare", "audit"])
def test_a_config_file_error_names_the_file_the_line_and_what_to_do(command, tmp_path, capsys, monkeypatch):
    """YAML that does not parse, and a value of the wrong type in a config file: one line naming
    the file (the line and column for YAML), exit 2, no traceback, in both command lines."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))  # the audit puts the working directory on it
    bad, typed = tmp_path / "bad.yaml", tmp_path / "typed.yaml"
    bad.write_text("steps: 3\n  devices: [\n")
    typed.write_text("steps: ten\n")
    code, err = _run(capsys, *command, "--config", str(bad), "--out", str(tmp_path / "o"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert (f"--config {bad} is not valid YAML (line 2, column 10: mapping values are not allowed in this context): "
            "fix that line, or start from the file --print_config writes") in err, err
    code, err = _run(capsys, *command, "--config", str(typed), "--out", str(tmp_path / "o"))
    assert code == 2 and err.strip().endswith(f"--config {typed}: --steps: expected int, got 'ten'"), err
    assert not (tmp_path / "o").exists()


AUDIT = ["audit", "--model", "examples.audit_models.Plain", "--data", "examples.audit_models.Regression"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan"])
@pytest.mark.parametrize("command", [["compare", "--steps", "1"], AUDIT], ids=["compare", "audit"])
def test_a_bad_watchdog_setting_is_refused_before_any_work(command, value, tmp_path, capsys, monkeypatch):
    """VAE_DDP_WATCHDOG_S that is not a number of seconds above 0 reached the runs (exit 3, 'could not
    convert string to float'): one line, exit 2, nothing written."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    monkeypatch.setenv("VAE_DDP_WATCHDOG_S", value)
    code, err = _run(capsys, *command, "--out", str(tmp_path / "o"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"VAE_DDP_WATCHDOG_S='{value}' is not a number of seconds above 0" in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", [["compare", "--steps", "1"], AUDIT], ids=["compare", "audit"])
def test_ctrl_c_while_it_imports_is_130_without_a_traceback(command, tmp_path):
    """Ctrl-C in the first second (the command still imports jsonargparse, torch and Lightning)
    printed a Python traceback and ended by the signal (-2): one line and exit code 130 now."""
    import contextlib
    import signal
    import subprocess
    import sys

    # at several moments of the imports: a Ctrl-C 1 to 3 s after the start ended 4 runs of 10 with -2 (CPython
    # re-raised SIGINT at exit after main had caught it and returned 130)
    for i, delay in enumerate((1.0, 1.6, 2.2)):
        # a terminal's Ctrl-C: SIGINT at its default in the command, whatever this run inherited (a shell's
        # background job ignores it, and the command keeps an ignored SIGINT ignored)
        proc = subprocess.Popen([sys.executable, "-m", "vae_ddp.cli", *command, "--out", str(tmp_path / f"o{i}")],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            with contextlib.suppress(subprocess.TimeoutExpired):  # the moment of the signal (earlier if it ended)
                proc.wait(timeout=delay)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 130 and "Traceback" not in err, (delay, proc.returncode, err)
        assert err.strip().splitlines()[-1] in ("vae-ddp: interrupted", "vae-ddp audit: interrupted; no verdict"), err


@pytest.mark.timeout(60)
def test_a_runs_folder_planted_as_a_link_is_refused(tmp_path, capsys):
    """compare into a --out whose runs folder is a link (planted where others can write) wrote its
    runs' logs and tensors through it: one line, exit 2, nothing written there."""
    victim = tmp_path / "victim"
    victim.mkdir()
    out = tmp_path / "o"
    out.mkdir()
    (out / "runs").symlink_to(victim)
    code, err = _run(capsys, "compare", "--configs", "[single]", "--steps", "1", "--out", str(out))
    assert code == 2 and err.count("\n") == 1 and f"{out / 'runs'} is a link to {victim}" in err, err
    assert list(victim.iterdir()) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", [["compare", "--steps", "1"], AUDIT], ids=["compare", "audit"])
def test_sigterm_while_it_imports_is_143_and_one_line(command, tmp_path):
    """SIGTERM 0.5, 2 and 5 s after the start (the command imports jsonargparse, torch and Lightning,
    or has just begun) ended by the signal (-15) with nothing on stderr, while SIGTERM later said
    ``vae-ddp: terminated`` with exit code 143: the same now from the command's first line of code."""
    import contextlib
    import signal
    import subprocess
    import sys

    for i, delay in enumerate((0.5, 2.0, 5.0)):
        proc = subprocess.Popen([sys.executable, "-m", "vae_ddp.cli", *command, "--out", str(tmp_path / f"o{i}")],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            with contextlib.suppress(subprocess.TimeoutExpired):  # the moment of the signal (earlier if it ended)
                proc.wait(timeout=delay)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert proc.returncode == 143 and "Traceback" not in err, (delay, proc.returncode, err)
        assert err.strip().splitlines()[-1] == "vae-ddp: terminated", (delay, err)


def _started_with(mark: str) -> list[int]:
    """Live (not zombie) processes whose environment holds ``VAE_DDP_TEST_MARK=mark``: whatever the command
    started, however it started them (they inherit its environment)."""
    from pathlib import Path

    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and f"VAE_DDP_TEST_MARK={mark}".encode() in (d / "environ").read_bytes().split(b"\0") \
                    and (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(d.name))
        except OSError:
            continue
    return found


def _still_running(pids: list[int], seconds: float) -> list[int]:
    """Those of ``pids`` still running ``seconds`` after the call: each pidfd turns readable when its process
    ends (an event, not a poll of a condition)."""
    import select
    import time

    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + seconds
    try:
        while fds and (left := deadline - time.monotonic()) > 0:
            for fd in select.select(list(fds), [], [], left)[0]:
                os.close(fd)
                fds.pop(fd)
        return sorted(fds.values())
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("refusal", ["out is a file", "lock is a link", "API: out is a file"])
def test_no_process_outlives_a_fast_refusal(tmp_path, refusal):
    """After a refusal (exit 2) the zygote the audit had started (``--zygote vae_ddp.audit.run``) went on
    importing torch and Lightning, busy, 8-13 s after the command returned: 2 s after it, no process it
    started is running (whatever layer starts them: the test finds them by a variable of their environment)."""
    import signal
    import subprocess
    import sys
    import uuid

    mark, out = uuid.uuid4().hex, tmp_path / "o"
    if refusal.endswith("out is a file"):
        out.write_text("")
    else:
        out.mkdir()
        (out / ".vae-ddp.lock").symlink_to(tmp_path / "victim")
    if refusal.startswith("API"):
        cmd = [sys.executable, "-c", "import sys; from vae_ddp.audit.api import audit; from examples.audit_models "
               f"import Plain, Regression; audit(Plain, Regression, out={str(out)!r})"]
    else:
        cmd = [sys.executable, "-m", "vae_ddp.cli", *AUDIT, "--out", str(out)]
    err = tmp_path / "stderr.txt"
    try:
        with open(err, "w") as stderr:  # a file, not a pipe: a pipe's reader would wait for every writer to end
            code = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, VAE_DDP_TEST_MARK=mark),
                                  stdout=subprocess.DEVNULL, stderr=stderr, timeout=180).returncode
        assert code == (1 if refusal.startswith("API") else 2), err.read_text()[-2000:]
        left = _still_running(_started_with(mark), 2.0)
        assert not left, [open(f"/proc/{p}/cmdline").read().replace("\0", " ") for p in left]
    finally:
        for pid in _started_with(mark):
            os.kill(pid, signal.SIGKILL)


M = "examples.audit_models"


def _refused_without_torch(*args: str, cwd=ROOT) -> str:
    """``vae-ddp ARGS`` as the console command runs it (``entry``), with ``-X importtime``: exit code 2,
    one line and no traceback on stderr, and neither torch nor Lightning imported before the refusal
    (importtime names every module the process imported). Returns the line."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "vae_ddp.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    imported = {ln.rsplit("|", 1)[1].strip() for ln in proc.stderr.splitlines() if ln.startswith("import time:")}
    said = [ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:")]
    assert "vae_ddp.audit.argv" in imported  # the probe reads the imports (the refusal is this module's)
    assert proc.returncode == 2 and len(said) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    heavy = {m for m in imported if m.split(".")[0] in ("torch", "pytorch_lightning", "lightning")}
    assert not heavy, sorted(heavy)[:5]
    return said[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("args, line", [
    ([], "vae-ddp audit: error: the following arguments are required: --data, --model: give your LightningModule "
         "as --model package.module.Class or path/to/file.py:Class, and your LightningDataModule as --data (see -h)"),
    (["--model", f"{M}.Plain"], "the following arguments are required: --data: give your LightningDataModule"),
    # argparse took --step for --steps (a prefix of one flag)
    (["--model", f"{M}.Plain", "--data", f"{M}.Regression", "--step", "3"],
     "vae-ddp audit: error: unrecognized arguments: --step 3 (did you mean --steps? flags are not abbreviated)"),
    (["--model", f"{M}.Plain", "--data", f"{M}.Regression", "--stpes", "3"],
     "vae-ddp audit: error: unrecognized arguments: --stpes 3 (did you mean --steps?)"),
    (["--modle", f"{M}.Plain", "--data", f"{M}.Regression"],
     "vae-ddp audit: error: unrecognized arguments: --modle examples.audit_models.Plain (did you mean --model?)"),
    (["--model", f"{M}.Plain", "--data", f"{M}.Regression", "--modle.init_args.p=0.5"],
     "unrecognized arguments: --modle.init_args.p=0.5 (did you mean --model.init_args.p?)"),
    # a class path of no file.py: it said "not a LightningModule subclass"
    (["--model", "shapes:Net", "--data", f"{M}.Regression"],
     "vae-ddp audit: error: --model shapes:Net names no file.py: give path/to/file.py:Class or package.module.Class"),
    (["--model", "examples/audit_models:Plain", "--data", f"{M}.Regression"],
     "--model examples/audit_models:Plain names no file.py: give path/to/file.py:Class or package.module.Class "
     "(examples/audit_models.py exists: --model examples/audit_models.py:Plain)"),
    (["--model", f"{M}.Plain", "--data", "examples/missing.py:Data"],
     "--data: examples/missing.py does not exist: give path/to/file.py:Class or package.module.Class"),
    (["--model", "Plain", "--data", f"{M}.Regression"],
     "--model Plain is not a class path: give path/to/file.py:Class or package.module.Class"),
    (["--model", "examples/audit_models.py", "--data", f"{M}.Regression"],
     "--model examples/audit_models.py names no class: give examples/audit_models.py:Class"),
    (["--model", "exmaples.audit_models.Plain", "--data", f"{M}.Regression"],
     "--model exmaples.audit_models.Plain does not import (ModuleNotFoundError: No module named 'exmaples'): give "
     "package.module.Class or path/to/file.py:Class (did you mean examples?)"),
    (["--model", f"{M}.Plain", "--data", f"{M}.Regression", "--steps"], "--steps: expected a value (see -h)"),
], ids=["nothing", "no data", "abbreviated", "misspelled", "misspelled class flag", "misspelled nested flag",
        "no .py", "no .py but the file", "no file", "no module", "no class", "no such package", "no value"])
def test_what_the_command_line_tells_is_refused_before_torch_is_imported(args, line):
    """``vae-ddp audit`` with no arguments imported torch and Lightning for 4.6-6 s (12-21 s on a loaded machine)
    before saying that --model and --data are required: whatever the arguments alone tell is refused before
    torch, Lightning or the user's file is imported (the timing is benchmarks/cli_errors.py's)."""
    said = _refused_without_torch("audit", *args)
    assert line in said, said


def test_a_refused_command_line_imports_no_user_file(tmp_path, capsys, monkeypatch):
    """In this process (torch is imported here): a misspelled flag beside a class of a file is refused
    before that file is imported (it would run the user's module-level code)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    (tmp_path / "net.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\nclass Net: pass\n")
    code, err = _run(capsys, "audit", "--model", f"{tmp_path}/net.py:Net", "--data", f"{M}.Regression",
                     "--effect_batchs", "0", "--out", str(tmp_path / "o"))
    assert code == 2 and err.strip() == ("vae-ddp audit: error: unrecognized arguments: --effect_batchs 0 "
                                         "(did you mean --effect_batches?)"), err
    assert not (tmp_path / "imported").exists() and not (tmp_path / "o").exists()


def test_the_early_checks_know_every_flag_of_the_audits_parser():
    """The checks before any import (``vae_ddp.audit.argv``) list the parser's flags themselves: the same set."""
    from vae_ddp.audit.argv import FLAGS
    from vae_ddp.audit.cli import build_parser

    assert set(FLAGS) == set(build_parser()._option_string_actions)


@pytest.mark.parametrize("args", [["--step", "3"], ["--ste=3"], ["--dev", "4"]])
def test_the_audits_parser_takes_no_abbreviation(args, monkeypatch):
    """jsonargparse (argparse) read ``--step 3`` as ``--steps 3``; the parser itself refuses it too."""
    import argparse

    from vae_ddp.audit.cli import build_parser

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("sys.path", [str(ROOT), *__import__("sys").path])

    with pytest.raises(argparse.ArgumentError, match="unrecognized arguments"):
        build_parser().parse_args(["--model", f"{M}.Plain", "--data", f"{M}.Regression", *args])


def test_a_class_path_of_no_file_in_a_config_is_named_as_such(tmp_path, capsys, monkeypatch):
    """A config file's ``class_path: shapes:Net`` (read by the parser, after the early checks) said
    'not a LightningModule subclass': the same line as on the command line."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    (tmp_path / "c.yaml").write_text("model:\n  class_path: shapes:Net\n")
    code, err = _run(capsys, "audit", "--config", str(tmp_path / "c.yaml"), "--data", f"{M}.Regression",
                     "--out", str(tmp_path / "o"))
    assert code == 2 and err.strip() == ("vae-ddp audit: error: --model shapes:Net names no file.py: give "
                                         "path/to/file.py:Class or package.module.Class"), err
