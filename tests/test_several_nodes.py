"""Lightning on 2 nodes started by torchrun (c10d rendezvous, gloo) against one device and one node."""

import shutil
import sys
from pathlib import Path

import pytest
from helpers import ROOT

TORCHRUN = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))


@pytest.mark.skipif(not Path(TORCHRUN).exists(),
                    reason="torchrun is not installed next to this Python (torch's launcher)")
def test_two_nodes_reach_the_one_node_floor(generated):
    """float64, every fix on: 2 nodes x 1 device equals 1 node x 2 devices bit for bit (same
    world size, same per-device batches, same reduction order), and 2 nodes x 2 devices is as
    close to the single device as one node is (within 10x, at float64 rounding). The run is the
    one the "Several nodes" page shows (docs registry entry ``several_nodes``)."""
    result = generated("several_nodes")
    diffs, floor = result["diffs"], result["one_node"]
    assert 0 < floor < 1e-12 * result["scale"] * 100, result  # one node: at float64 rounding, not bitwise
    assert result["from_one_node"]["2x1"] == 0.0, result
    assert diffs["2x2"] <= 10 * floor, result
    stdout = (ROOT / "docs" / "generated" / "several_nodes" / "stdout.txt").read_text()
    assert "2 x torchrun" in stdout and "--rdzv-backend c10d" in stdout
    # Home's "change in the report's own script": the command that ran on one node with 2 devices, and
    # how far it ended from one device, from this run
    shown = (ROOT / "docs" / "generated" / "several_nodes" / "report_script.md").read_text()
    assert "python examples/vae.py fit" in shown and "--trainer.devices 2" in shown, shown
    assert "vae_ddp.fixes.GlobalSyncBatchNorm" in shown and "--model.sync_dist_logging true" in shown
    assert f"within {floor:.3g} of one device's" in shown
