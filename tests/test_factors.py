"""Each factor: the effect is there with Lightning's defaults and gone with the fix.

Every test runs the example script that the documentation shows (one source of truth) as
its own process (DDP re-runs the command for rank 1) and reads the JSON it writes.
"""

import json
import subprocess
import sys

import pytest

from conftest import ROOT


def run_example(name: str, out, *args: str) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / f"{name}.py"), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), "the example prints its result"
    return json.loads((out / f"{name}.json").read_text())


def test_noise_is_identical_across_ranks_by_default_and_independent_when_fixed(tmp_path):
    r = run_example("factor_noise", tmp_path, "--steps", "3")
    assert r["default"]["identical_fraction"] == 1.0
    assert r["default"]["corr_rank0_rank1"] == pytest.approx(1.0)
    for fix in ("per_rank", "global"):
        assert r[fix]["identical_fraction"] == 0.0
        assert abs(r[fix]["corr_rank0_rank1"]) < 0.05
    assert r["global"]["max_abs_diff_vs_single_device"] == 0.0  # world-size independent noise


def test_batchnorm_per_rank_changes_gradients_and_sync_restores_them(tmp_path):
    r = run_example("factor_batchnorm", tmp_path, "--model", "small")
    assert r["default"]["bn_output_max_abs_diff"] > 1e-3
    assert r["default"]["grad_rel_diff_all"] > 1e-3
    assert r["sync_bn"]["bn_output_max_abs_diff"] < 1e-10
    assert r["sync_bn"]["grad_rel_diff_all"] < 1e-10  # float64: rounding only


def test_default_samplers_see_different_samples_and_global_sampler_the_same(tmp_path):
    r = run_example("factor_sampler", tmp_path, "--steps", "3")
    assert max(r["default"]["shared_fraction_per_step"]) < 0.5 and not r["default"]["same_order"]
    assert r["global"]["shared_fraction_per_step"] == [1.0] * 3 and r["global"]["same_order"]
    n = r["train_size"]
    assert r["padding"] == {str(w): (-n) % w for w in (2, 3, 4, 8)}


def test_mean_of_rank_means_is_the_global_mean_only_for_equal_batches(tmp_path):
    r = run_example("factor_reduction", tmp_path)
    equal, uneven, padded = r.values()
    assert equal["loss_rel_diff"] < 1e-12 and equal["grad_rel_diff"] < 1e-10
    assert uneven["loss_rel_diff"] > 1e-3 and uneven["grad_rel_diff"] > 1e-3
    assert padded["loss_rel_diff"] > 1e-4 and padded["grad_rel_diff"] > 1e-4


def test_unsynced_logging_shows_rank0_and_sync_dist_the_global_value(tmp_path):
    r = run_example("factor_logging", tmp_path, "--steps", "8")
    assert r["default"]["loss"]["mean_abs_diff"] > 1e-4
    assert r["sync_dist"]["loss"]["max_abs_diff"] < 1e-6
    v = r["validation"]
    assert v["rank0_share"] == (v["val_size"] + 1) // 2
    assert abs(v["loss_rank0"] - v["loss_all"]) > 1e-5


def test_shared_noise_raises_gradient_variance_and_adams_second_moment(tmp_path):
    r = run_example("factor_optimizer", tmp_path, "--steps", "10")
    gv = r["gradient_variance"]
    assert gv["shared"]["fc_mu/fc_var"] > 1.1 * gv["independent"]["fc_mu/fc_var"]
    runs = r["runs"]
    ratio = lambda name: runs[name]["adam_v"]["fc_mu/fc_var"] / runs["single"]["adam_v"]["fc_mu/fc_var"]  # noqa
    assert ratio("ddp (default)") > ratio("ddp + global noise")
