"""Lightning on 2 nodes started by torchrun (c10d rendezvous, gloo) against one device and one node."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))


@pytest.mark.skipif(not Path(TORCHRUN).exists(), reason="torchrun is not installed next to this Python (torch's launcher)")
def test_two_nodes_reach_the_one_node_floor(tmp_path):
    """float64, every fix on, 2 Adam steps: 2 nodes x 1 device equals 1 node x 2 devices bit for bit
    (same world size, same per-device batches, same reduction order), and 2 nodes x 2 devices
    is as close to the single device as one node is (within 10x, at float64 rounding)."""
    proc = subprocess.run([sys.executable, "examples/several_nodes.py", "--out", str(tmp_path), "--steps", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=3000, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "several_nodes.json").read_text())
    diffs, floor = result["diffs"], result["one_node"]
    assert 0 < floor < 1e-12 * result["scale"] * 100, result  # one node: at float64 rounding, not bitwise
    assert result["from_one_node"]["2x1"] == 0.0, result
    assert diffs["2x2"] <= 10 * floor, result
    assert "2 x torchrun" in proc.stdout and "--rdzv-backend c10d" in proc.stdout
