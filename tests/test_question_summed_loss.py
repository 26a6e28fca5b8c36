"""A summed loss under DDP (docs/questions/summed-loss.md): the measured facts."""

import pytest


def test_a_summed_loss_gives_one_over_the_world_size_of_the_gradient_and_the_step(generated):
    r = generated("summed_loss")
    s, n = r["sum"], r["world_size"]
    assert s["grad_ratio"] == pytest.approx(1 / n, abs=1e-12)
    assert s["step_ratio"] == pytest.approx(1 / n, abs=1e-12)
    assert s["grad_rel_diff"] > 0.4 and s["step_rel_diff"] > 0.4


@pytest.mark.parametrize("loss", ["sum_times_world_size", "mean"])
def test_the_sum_times_the_world_size_and_the_mean_reproduce_one_device(generated, loss):
    r = generated("summed_loss")[loss]
    assert r["grad_rel_diff"] < 1e-13  # float64 rounding
    assert r["step_rel_diff"] < 1e-12
    assert r["grad_ratio"] == pytest.approx(1, abs=1e-12)
