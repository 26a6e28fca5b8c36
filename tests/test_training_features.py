"""Other training features under the recipe (examples/training_features.py): DDP on 2 gloo
processes with every fix against one device, float64, a tiny model that is not the VAE."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("features")
    proc = subprocess.run([sys.executable, "examples/training_features.py", "--out", str(out), "--steps", "8"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads((out / "training_features.json").read_text())


@pytest.fixture(scope="module")
def diffs(result) -> dict:
    return result["diffs"]


def test_the_floor_is_float64_rounding(result, diffs):
    """No feature: DDP vs one device stays at float64 rounding, as amplified by Adam (a bias just
    before a BatchNorm has an exactly zero gradient, so its Adam step is rounding / eps); every
    other parameter is within a few ulps."""
    assert 0 <= diffs["none"] < 1e-9, diffs
    for feature in ("none", "two_optimizers", "accumulate", "workers_keyed"):
        assert result["without_pre_bn_bias"][feature] < 1e-14, result


@pytest.mark.parametrize("feature", ["two_optimizers", "accumulate", "workers_keyed"])
def test_feature_reaches_the_floor(diffs, feature):
    """Within 10x the no-feature floor of the same run (both at float64 rounding)."""
    assert diffs[feature] <= 10 * max(diffs["none"], 1e-16), diffs


def test_augmentation_seeded_per_rank_and_worker_is_the_documented_residual(diffs):
    """seed_everything(workers=True) gives every (rank, worker) its own stream: DDP draws other
    augmentations than one device, a difference of the augmentation's size, not rounding."""
    assert diffs["workers_seeded"] > 1e6 * max(diffs["none"], 1e-16) and diffs["workers_seeded"] > 1e-4, diffs
