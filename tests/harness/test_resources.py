"""A world size whose memory does not fit is refused before launch, with the estimate; what fits
runs (4 ranks on 2 cores)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)


def test_a_world_size_that_does_not_fit_is_refused_before_launch(tmp_path, monkeypatch):
    """--devices 64 with 2 GB available: one line with the estimate and what fits, exit 2, no
    process started and nothing written (it started 67 processes and took 129 s for one step)."""
    import vae_ddp.harness.launch as launch
    import vae_ddp.harness.resources as resources
    from vae_ddp.cli import main_captured

    monkeypatch.setattr(resources, "_available_memory", lambda: 2 * 10 ** 9)
    started = []
    monkeypatch.setattr(launch.guard, "run", lambda *a, **k: started.append(a))
    out = tmp_path / "o"
    code, stdout, err = main_captured(["compare", "--configs", "[ddp]", "--devices", "64", "--steps", "2",
                                       "--out", str(out)])
    assert code == 2 and err.count("\n") == 1, err
    assert "64 processes need about 10.4 GB of memory (162.7 MB each), 2.0 GB is available" in err, err
    assert "use at most 12 processes" in err and not started and not out.exists()


def test_four_ranks_fit_here():
    """The estimate lets 4 ranks of the small VAE run where they ran (a few hundred MB)."""
    from vae_ddp.harness.configs import RunSpec
    from vae_ddp.harness.resources import check_memory

    check_memory(RunSpec(config="ddp", devices=4).validate())
