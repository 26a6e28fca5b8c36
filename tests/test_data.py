"""The checked image folder's cache follows the files: a changed image is decoded (checked) again."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.timeout(120)


def test_an_image_changed_after_a_run_is_checked_again(tmp_path, capsys, monkeypatch):
    """The checked-folder cache is keyed on each file's size and modification time: an image
    overwritten with 300 bytes of garbage after a first check is named by the next run, exit 2
    (it was served from the cache of the paths and labels, and the run trained)."""
    from torchvision.io import write_png

    from vae_ddp.cli import main
    from vae_ddp.data import check_data

    monkeypatch.setenv("VAE_DDP_CACHE", str(tmp_path / "cache"))
    for c in ("cat", "dog"):
        (tmp_path / "imgs" / c).mkdir(parents=True)
        for i in range(3):
            write_png(torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8), str(tmp_path / "imgs" / c / f"{i}.png"))
    check_data("imagefolder", str(tmp_path / "imgs"))
    changed = tmp_path / "imgs" / "dog" / "1.png"
    changed.write_bytes(os.urandom(300))
    code = main(["compare", "--data", "imagefolder", "--data_dir", str(tmp_path / "imgs"),
                 "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and f"cannot read image {changed}" in err, err
    assert len(list((tmp_path / "cache").glob("imagefolder-*.pt"))) == 1  # the first check's, not a second
