"""Results that survive a kill: a study's files are replaced as one set (the old complete set or
the new complete set, never a mix, never an empty file), a full file system is named in one
line, and what a killed run left is removed by the next run into the folder. In-process or one
small interpreter each: seconds."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = pytest.mark.timeout(120)

FILES = ("results.json", "curves.png", "report_style.png", "tables.md")


def canned(tag: float) -> tuple[dict, list, str, str]:
    """What ``compare`` writes, made up: ``tag`` sets every value (two tags, two distinct sets)."""
    records = [{"config": "single", "label": "single", "step": s, "recon_loss": tag + s, "kl": tag * s,
                "loss": 2 * tag + s, "logged_recon_loss": tag + s, "logged_kl": tag * s, "logged_loss": tag}
               for s in range(1, 6)]
    result = {"settings": {"steps": 5}, "configs": ["single"], "records": records, "tag": tag}
    series = [("single", records, [])]
    return result, series, f"| tag |\n|-----|\n| {tag} |", f"made-up set {tag}"


def _snapshot(folder):
    return {f: (folder / f).read_bytes() for f in FILES}


SCRIPT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from test_outputs import canned
import vae_ddp.studies.compare as compare
from pathlib import Path
out = Path({out!r})
def killed(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
compare.plot_report_style = killed  # kill -9 between the set's files: results.json and curves.png written
compare.write_results(out, *canned(2.0))
"""


def test_a_kill_between_the_files_leaves_the_old_set_whole(tmp_path):
    """kill -9 after two of the four files of a new set were written: the folder still holds
    the old set, byte for byte (it held the new results.json beside the old figures before);
    the next run into the folder removes what the killed one left beside it."""
    from vae_ddp.studies.compare import write_results
    from vae_ddp.utils import out_folder_lock

    out = tmp_path / "out"
    write_results(out, *canned(1.0))
    old = _snapshot(out)
    code = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=str(ROOT / "tests"), out=str(out))],
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), timeout=90).returncode
    assert code == -9
    assert _snapshot(out) == old
    assert [p.name for p in tmp_path.iterdir() if p.name != "out"]  # the killed run's new set, beside
    with out_folder_lock(out, "next run"):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert _snapshot(out) == old


def test_a_failure_between_the_files_leaves_the_old_set(tmp_path, monkeypatch):
    """An exception while the new set is written: the old set stays whole, nothing of the new
    one is left; then a complete write replaces all four files and keeps the folder's other files."""
    import vae_ddp.studies.compare as compare

    out = tmp_path / "out"
    compare.write_results(out, *canned(1.0))
    (out / "runs").mkdir()
    (out / "runs" / "stderr.log").write_text("kept")
    old = _snapshot(out)

    def broken(*args, **kwargs):
        raise RuntimeError("drawing failed")

    with monkeypatch.context() as m:
        m.setattr(compare, "plot_report_style", broken)
        with pytest.raises(RuntimeError, match="drawing failed"):
            compare.write_results(out, *canned(2.0))
    assert _snapshot(out) == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    compare.write_results(out, *canned(3.0))
    new = _snapshot(out)
    assert all(new[f] != old[f] for f in FILES) and all(new[f] for f in FILES)
    assert (out / "runs" / "stderr.log").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_full_disk_while_writing_a_file_leaves_the_old_file(tmp_path, monkeypatch):
    """ENOSPC in the middle of a file: the old file stays (it was truncated to 0 bytes before),
    nothing half-written is left, and the error is one line naming the folder and the size."""
    from vae_ddp.outputs import OutOfSpace, write_atomic

    target = tmp_path / "results.json"
    target.write_text("old")
    real = type(target).write_text

    def full(self, data, *args, **kwargs):
        with open(self, "w") as f:
            f.write(data[:2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(target), "write_text", full)
    with pytest.raises(OutOfSpace) as caught:
        write_atomic(target, "new contents")
    monkeypatch.setattr(type(target), "write_text", real)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
    text = str(caught.value)
    assert "\n" not in text and str(tmp_path) in text and "about 12 bytes needed" in text and "no space left" in text
    assert caught.value.errno == errno.ENOSPC


def test_a_full_disk_while_writing_the_set_is_named(tmp_path, monkeypatch):
    """ENOSPC while the set is written: OutOfSpace naming --out, the old set whole."""
    import vae_ddp.studies.compare as compare
    from vae_ddp.outputs import OutOfSpace

    out = tmp_path / "out"
    compare.write_results(out, *canned(1.0))
    old = _snapshot(out)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(compare, "plot_curves", full)
    with pytest.raises(OutOfSpace, match=f"no space left on the file system of {out}"):
        compare.write_results(out, *canned(2.0))
    assert _snapshot(out) == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_kill_9_inside_a_file_write_leaves_no_empty_file(tmp_path):
    """kill -9 while a params file is written (torch.save half done): the old file stays whole."""
    target = tmp_path / "params-0.pt"
    target.write_bytes(b"old params")
    script = textwrap.dedent(f"""
        import os, signal
        from vae_ddp.outputs import replacing
        with replacing({str(target)!r}) as tmp:
            tmp.write_bytes(b"half")
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    code = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
                          timeout=60).returncode
    assert code == -9
    assert target.read_bytes() == b"old params"
    from vae_ddp.outputs import clean_stale

    clean_stale(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["params-0.pt"]


def _canned_launch(specs, out_dir, **kwargs):
    """``launch_by_world_size`` without training: two made-up steps per spec."""
    records = [{"step": s, "recon_loss": 1.0 / s, "kl": 0.1 * s, "loss": 1.0, "logged_recon_loss": 1.0 / s,
                "logged_kl": 0.1 * s, "logged_loss": 1.0, "global_batch_size": 64} for s in (1, 2)]
    return [({"spec": {}, "runs": [{"seed": 0, "records": records, "val_records": [], "params": None}]}, out_dir)
            for _ in specs]


def test_a_full_disk_after_training_is_one_line_and_exit_3(tmp_path, monkeypatch):
    """ENOSPC while compare writes its results (after training): one line naming --out, exit 3,
    the earlier results whole and no empty file (it was a 10-line torch traceback, and a 0-byte
    file was left)."""
    import vae_ddp.studies.compare as compare
    from vae_ddp.cli import main_captured

    out = tmp_path / "out"
    compare.write_results(out, *canned(1.0))
    old = _snapshot(out)
    monkeypatch.setattr(compare, "launch_by_world_size", _canned_launch)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(compare, "plot_report_style", full)
    code, _, err = main_captured(["compare", "--configs", "[single]", "--steps", "2", "--out", str(out)])
    assert code == 3 and err.count("\n") == 1 and f"no space left on the file system of {out}" in err, err
    assert _snapshot(out) == old
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size == 0]


def test_too_little_space_before_training_is_one_line_and_exit_2(tmp_path, monkeypatch):
    """Less free space than the run writes (its parameters, logs): refused before it starts, in one
    line with both sizes and the folder, exit 2 (it trained, then failed writing)."""
    import vae_ddp.outputs as outputs
    from vae_ddp.cli import main_captured

    monkeypatch.setattr(outputs, "_free", lambda folder: 10 ** 6)
    out = tmp_path / "out"
    code, stdout, err = main_captured(["compare", "--configs", "[single]", "--steps", "2", "--out", str(out)])
    assert code == 2 and err.count("\n") == 1, err
    assert f"the file system of {out / 'runs'} has 1.0 MB free, the run writes about 6.3 MB" in err, err
    assert "step 1" not in stdout and not out.exists()  # nothing left of it


def test_a_set_written_into_the_working_folder_keeps_it(tmp_path, monkeypatch):
    """--out . : the files are replaced one by one (each whole), the working folder is not swapped
    away from under the run."""
    from vae_ddp.studies.compare import write_results

    monkeypatch.chdir(tmp_path)
    write_results(".", *canned(1.0))
    write_results(".", *canned(2.0))
    assert Path.cwd() == tmp_path and tmp_path.is_dir()
    assert b'"tag": 2.0' in (tmp_path / "results.json").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(FILES)
