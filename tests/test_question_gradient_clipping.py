"""Gradient clipping under DDP (docs/questions/gradient-clipping.md): the measured facts."""

import pytest

ALGORITHMS = ["norm", "value"]


def test_the_clip_is_active_and_comes_after_on_before_optimizer_step(generated):
    r = generated("gradient_clipping")
    own = r["rank_clips_norm_own_grad_norms"]
    assert min(r["global_grad_norm"], *own) > 5 * r["clip"]["norm"]
    assert r["one_device_update_norm"]["norm"] == pytest.approx(r["clip"]["norm"], rel=1e-5)
    assert r["one_device_value_update_max_abs"] == pytest.approx(r["clip"]["value"], rel=1e-12)
    # the gradient the callback kept under clipping is minus the update of a run without clipping
    assert r["unclipped_update_vs_seen"] < 1e-13


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_gradient_clip_val_under_ddp_is_one_devices(generated, algorithm):
    r = generated("gradient_clipping")
    lightning = r[f"lightning_{algorithm}"]
    assert lightning["seen_rel_diff"] < 1e-13  # all-reduced before on_before_optimizer_step
    assert lightning["update_rel_diff"] < 1e-13  # float64 rounding
    assert lightning["update_norm"] == pytest.approx(r["one_device_update_norm"][algorithm], rel=1e-12)
    assert r[f"all_reduce_then_clip_{algorithm}"]["update_rel_diff"] < 1e-13


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_clipping_each_ranks_own_gradient_first_differs(generated, algorithm):
    r = generated("gradient_clipping")
    own = r[f"rank_clips_{algorithm}_own_grad_norms"]
    assert own == r[f"all_reduce_then_clip_{algorithm}_own_grad_norms"]
    assert abs(own[0] - own[1]) > 0.1  # each rank kept its own gradient: no all-reduce in that backward
    assert r["global_grad_norm"] < sum(own) / len(own)  # the norm of the mean, below the mean of the norms
    assert r[f"rank_clips_{algorithm}"]["update_rel_diff"] > 0.05


def test_clipping_each_rank_by_norm_shortens_the_update(generated):
    r = generated("gradient_clipping")
    assert r["rank_clips_norm"]["update_norm"] < 0.95 * r["clip"]["norm"]
