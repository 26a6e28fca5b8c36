"""Bad input: one line on stderr saying what is wrong and what to do, exit code 2, no traceback,
before any training starts (no output folder is written)."""

import pytest
import torch

from conftest import run_cli
from vae_ddp.cli import main


def _run(capsys, *args):
    code = main(list(args))
    return code, capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--global-batch-size", "255", "--devices", "2"], "global batch size 255 is not divisible by 2 devices"),
    (["--data", "imagefolder", "--data-dir", "/nonexistent/cifar"], "--data-dir /nonexistent/cifar does not exist"),
    (["--configs", "single", "fsdp"], "unknown configuration 'fsdp'"),
    (["--model", "resnet999"], "unknown model 'resnet999'"),
    (["--data", "mnist"], "unknown data 'mnist'"),
    (["--steps", "0"], "--steps must be at least 1"),
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
    code, err = _run(capsys, "compare", "--data", "imagefolder", "--data-dir", str(tmp_path / "empty"))
    assert code == 2
    assert f"{tmp_path / 'empty'} holds no images" in err
    assert "cifar10-jpg-subset" in err  # says where to get data


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has 2 CUDA devices: real DP can run")
def test_real_dp_without_two_cuda_devices_says_which_one_runs(tmp_path):
    """Through the installed console entry point: exit code and stderr as a user sees them."""
    proc = run_cli("compare", "--configs", "dp", "--dp", "real", "--out", str(tmp_path / "o"), timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1
    assert "--dp real needs 2 CUDA devices" in proc.stderr and "--dp emulate" in proc.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, message", [
    (["--lr", "-1"], "--lr must be positive"),
    (["--val-every", "-1"], "--val-every must be 0"),
    (["--max-samples", "3", "--global-batch-size", "4"], "--max-samples 3 is too small"),
    (["--data", "imagefolder", "--data-dir", "/etc/passwd"], "is a file, not a folder"),
])
def test_more_bad_input(args, message, tmp_path, capsys):
    code, err = _run(capsys, "compare", "--out", str(tmp_path / "o"), *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
