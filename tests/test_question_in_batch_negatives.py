"""In-batch negatives under DDP (docs/questions/in-batch-negatives.md): the measured facts."""


def test_negatives_per_rank_change_the_first_gradient(generated):
    r = generated("in_batch_negatives")
    per_rank = r["per_rank"]
    assert r["one_device_negatives_per_anchor"] == 2 * r["global_batch_size"] - 2
    assert per_rank["negatives_per_anchor"] == 2 * r["global_batch_size"] // r["world_size"] - 2
    assert per_rank["grad_rel_diff"] > 1e-2
    assert abs(per_rank["grad_norm_ratio"] - 1) > 1e-3  # not a rescaled copy either


def test_all_gather_with_gradients_reproduces_one_device(generated):
    r = generated("in_batch_negatives")
    for loss in ("gather_grads", "gather_grads_local_anchors"):
        assert r[loss]["negatives_per_anchor"] == r["one_device_negatives_per_anchor"], loss
        assert r[loss]["grad_rel_diff"] < 1e-13, loss  # float64 rounding, no rescaling


def test_all_gather_without_gradients_gives_one_over_the_world_size(generated):
    r = generated("in_batch_negatives")["gather_no_grads"]
    assert r["gathered_requires_grad"] is False
    assert r["grad_rel_diff"] > 0.4
    assert r["times_world_size_rel_diff"] < 1e-13
