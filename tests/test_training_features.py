"""Other training features under the recipe (examples/training_features.py): DDP on 2 gloo
processes with every fix against one device, float64, a tiny model that is not the VAE."""

import pytest


@pytest.fixture(scope="module")
def result(generated) -> dict:
    """The run the "Training features" page shows (docs registry entry ``training_features``)."""
    return generated("training_features")


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
