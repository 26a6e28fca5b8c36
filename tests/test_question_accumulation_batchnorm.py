"""Gradient accumulation, DDP, BatchNorm and broadcast_buffers (examples/accumulation_batchnorm.py)."""

DDP_RUNS = ("ddp", "no_broadcast", "no_forward_sync", "sync")


def test_accumulation_and_ddp_share_a_first_gradient_that_is_not_one_devices(generated):
    r = generated("accumulation_batchnorm")
    assert r["ddp"]["grad_rel_diff_vs_accumulate"] < 1e-12          # float64 rounding
    assert r["accumulate"]["grad_rel_diff_vs_one"] > 1e-2
    assert r["ddp"]["grad_rel_diff_vs_one"] > 1e-2
    for run in ("no_broadcast", "no_forward_sync"):                 # buffers do not enter a training forward
        assert r[run]["grad_rel_diff_vs_accumulate"] < 1e-12, run


def test_global_batchnorm_gives_one_devices_gradient_and_running_statistics(generated):
    r = generated("accumulation_batchnorm")
    s = r["sync"]
    assert s["grad_rel_diff_vs_one"] < 1e-12
    assert s["grad_rel_diff_vs_accumulate"] > 1e-2
    assert s["running_mean_rank0_vs_one"] < 1e-12 * max(1.0, s["running_mean_scale_one"])
    assert max(s["entering_rank1_vs_rank0"]) < 1e-15 and s["running_mean_rank1_vs_rank0"] < 1e-15


def test_accumulation_updates_the_running_statistics_once_per_micro_batch(generated):
    r = generated("accumulation_batchnorm")
    steps = r["steps"]
    assert r["one"]["bn_updates"] == [steps]
    assert r["accumulate"]["bn_updates"] == [2 * steps]
    for run in DDP_RUNS:
        assert r[run]["bn_updates"] == [steps, steps], run
    assert r["accumulate"]["running_mean_rank0_vs_one"] > 1e-3


def test_broadcast_buffers_gives_every_rank_rank_0s_buffers_at_each_forward(generated):
    r = generated("accumulation_batchnorm")
    assert r["ddp"]["entering_rank1_vs_rank0"] == [0.0] * r["steps"]   # broadcast before every forward
    assert r["ddp"]["running_mean_rank1_vs_rank0"] > 1e-3              # rank 1's last update stays local
    for run in ("no_broadcast", "no_forward_sync"):
        entering = r[run]["entering_rank1_vs_rank0"]
        assert entering[0] == 0.0 and min(entering[1:]) > 1e-3, run   # equal at the start, then apart
    # rank 0 never receives anything: its statistics (of its own samples only) are the same either way,
    # and not one device's
    assert r["rank0_broadcast_vs_no_broadcast"] == 0.0
    assert r["ddp"]["running_mean_rank0_vs_one"] > 1e-3
