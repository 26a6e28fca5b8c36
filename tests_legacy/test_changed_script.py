"""The change in 1.x names (examples/legacy/vae_changed.py) on Lightning 1.9.5: --same step trains one
device's step on 2 gloo processes, --same distribution and the report's script do not (change_check.py)."""

import json
from argparse import Namespace

from conftest import LEGACY

import change_check


def test_same_step_is_one_devices_step_and_the_others_are_not(tmp_path, data_dir):
    r = change_check.main(["--data_dir", data_dir, "--out", str(tmp_path)])
    assert r["lightning"].startswith("1.9")
    assert r["cpu_batchnorm"]  # the CPU stand-in for sync_batchnorm=True was used, and said so
    step, dist, report = (r["runs"][n] for n in ("DDP, --same step", "DDP, --same distribution",
                                                  "DDP, the report's script"))
    assert step["share_beyond_1pct_lr"] < 1e-4 and step["largest_buffer_diff"] == 0
    assert dist["share_beyond_1pct_lr"] > 0.3 and report["share_beyond_1pct_lr"] > 0.3
    assert dist["largest_buffer_diff"] > 1e-4 and report["largest_buffer_diff"] > 1e-4


def test_committed_change_check_is_what_it_renders():
    out = LEGACY / "results" / "change_check"
    result = json.loads((out / "change_check.json").read_text())
    assert (out / "change_check.md").read_text() == change_check.render(result)


def test_the_datamodule_takes_the_batch_size_of_the_command_line(data_dir):
    """bolts' from_argparse_args passes only the arguments __init__ names: --batch_size reaches the loader."""
    from imagefolder_cifar10 import ImageFolderCIFAR10DataModule

    dm = ImageFolderCIFAR10DataModule.from_argparse_args(Namespace(data_dir=data_dir, batch_size=4, num_workers=0))
    assert dm.batch_size == 4
