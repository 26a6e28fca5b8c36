"""Each factor: the effect is there with Lightning's defaults and gone with the fix.

Every test reads what the example script that the documentation shows (one source of
truth) wrote when the docs registry ran it (``generated`` in conftest.py: the same run, cached,
that the site includes; DDP examples run as their own processes).
"""

import pytest


def test_noise_is_identical_across_ranks_by_default_and_independent_when_fixed(generated):
    r = generated("factor_noise")
    assert r["default"]["identical_fraction"] == 1.0
    assert r["default"]["corr_rank0_rank1"] == pytest.approx(1.0)
    for fix in ("per_rank", "global"):
        assert r[fix]["identical_fraction"] == 0.0
        assert abs(r[fix]["corr_rank0_rank1"]) < 0.05
    assert r["global"]["max_abs_diff_vs_single_device"] == 0.0  # world-size independent noise


def test_batchnorm_per_rank_changes_gradients_and_sync_restores_them(generated):
    r = generated("factor_batchnorm")
    assert r["default"]["bn_output_max_abs_diff"] > 1e-3
    assert r["default"]["grad_rel_diff_all"] > 1e-3
    assert r["sync_bn"]["bn_output_max_abs_diff"] < 1e-10
    assert r["sync_bn"]["grad_rel_diff_all"] < 1e-10  # float64: rounding only


def test_default_samplers_see_different_samples_and_global_sampler_the_same(generated):
    r = generated("factor_sampler")
    assert max(r["default"]["shared_fraction_per_step"]) < 0.5 and not r["default"]["same_order"]
    steps = r["steps"]
    assert r["global"]["shared_fraction_per_step"] == [1.0] * steps and r["global"]["same_order"]
    n = r["train_size"]
    assert r["padding"] == {str(w): (-n) % w for w in (2, 3, 4, 8)}


def test_mean_of_rank_means_is_the_global_mean_only_for_equal_batches(generated):
    r = generated("factor_reduction")
    r.pop("summary")
    equal, uneven, padded = r.values()
    assert equal["loss_rel_diff"] < 1e-12 and equal["grad_rel_diff"] < 1e-10
    assert uneven["loss_rel_diff"] > 1e-3 and uneven["grad_rel_diff"] > 1e-3
    assert padded["loss_rel_diff"] > 1e-4 and padded["grad_rel_diff"] > 1e-4


def test_unsynced_logging_shows_rank0_and_sync_dist_the_global_value(generated):
    r = generated("factor_logging")
    assert r["default"]["loss"]["mean_abs_diff"] > 1e-4
    assert r["sync_dist"]["loss"]["max_abs_diff"] < 1e-6
    v = r["validation"]
    assert v["rank0_share"] == (v["val_size"] + 1) // 2
    assert abs(v["loss_rank0"] - v["loss_all"]) > 1e-5


def test_shared_noise_raises_gradient_variance_and_adams_second_moment(generated):
    r = generated("factor_optimizer")
    gv = r["gradient_variance"]
    assert gv["shared"]["fc_mu/fc_var"] > 1.1 * gv["independent"]["fc_mu/fc_var"]
    runs = r["runs"]
    ratio = lambda name: runs[name]["adam_v"]["fc_mu/fc_var"] / runs["single"]["adam_v"]["fc_mu/fc_var"]  # noqa
    assert ratio("ddp (default)") > ratio("ddp + global noise")
