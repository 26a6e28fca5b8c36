"""The learning rate at B/N per device (docs/questions/learning-rate.md): the measured facts."""

import pytest


@pytest.mark.parametrize("key", ["same_global_sgd", "same_global_adam"])
def test_the_same_global_batch_and_learning_rate_reproduce_one_device(generated, key):
    r = generated("learning_rate")[key]
    assert r["ddp_steps"] == r["one_device_steps"] == 8  # 2 epochs of 64 samples at global batch 16
    assert r["first_grad_rel_diff"] < 1e-13  # float64 rounding
    assert r["update_rel_diff"] < 1e-13


def test_a_doubled_global_batch_is_a_different_run_that_linear_scaling_only_approaches(generated):
    r = generated("learning_rate")
    same_lr, scaled = r["double_global"], r["double_global_scaled_lr"]
    assert same_lr["ddp_steps"] == scaled["ddp_steps"] == 4 and same_lr["one_device_steps"] == 8
    assert same_lr["first_grad_rel_diff"] > 0.1  # the mean over 32 samples, not over 16
    assert scaled["first_grad_rel_diff"] == same_lr["first_grad_rel_diff"]  # the first gradient comes before any step
    assert same_lr["update_rel_diff"] > 0.1
    # lr x world size moves the update closer to one device's at 16, but not to rounding
    assert 1e-3 < scaled["update_rel_diff"] < same_lr["update_rel_diff"]


def test_ddp_reproduces_one_device_at_its_own_global_batch(generated):
    r = generated("learning_rate")["double_global_vs_one_32"]
    assert r["ddp_steps"] == r["one_device_steps"] == 4
    assert r["first_grad_rel_diff"] < 1e-13 and r["update_rel_diff"] < 1e-13
