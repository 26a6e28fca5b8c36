"""GlobalBatchNorm (the CPU sync BatchNorm) against BatchNorm on the concatenated batch, 2 gloo ranks."""

import json
import socket
import sys

import pytest
from helpers import ROOT
import torch
from torch import nn

from vae_ddp import guard
from vae_ddp.fixes import GlobalBatchNorm, GlobalSyncBatchNorm

SCRIPT = ROOT / "tests" / "scripts" / "sync_bn_check.py"


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def two_rank_result() -> dict:
    port = free_port()
    procs = guard.run_all([[sys.executable, str(SCRIPT), str(r), "2", port] for r in range(2)], timeout=300,
                          capture_output=True, text=True)
    for p in procs:
        assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(procs[0].stdout)


@pytest.mark.parametrize("variant", ["1d (B, C)", "1d (B, C, L)", "2d", "2d channels-last", "3d", "affine=False",
                                     "track_running_stats=False", "momentum=None", "uneven per-rank batches"])
def test_global_batchnorm_equals_full_batch_batchnorm_in_float64(two_rank_result, variant):
    """Outputs, input/weight/bias gradients and running statistics over 3 steps, relative to the
    reference's scale: at float64 rounding (a few ulps)."""
    assert two_rank_result[variant] < 1e-14, two_rank_result


def test_global_statistics_stay_exact_when_the_mean_dwarfs_the_spread(two_rank_result):
    """Mean 1e4, std 1: summing (x - mean)**2 around the global mean (a second all-reduce) keeps
    the error at the conditioning of BatchNorm itself (1e4 x 2.2e-16); the variance from sums of x
    and x**2 -- one all-reduce, but cancelling -- is off by 1e-8 and more."""
    assert two_rank_result["mean 1e4, std 1"] < 1e-11
    assert two_rank_result["sum/sum-of-squares variance, mean 1e4"] > 1e3 * two_rank_result["mean 1e4, std 1"]


def test_convert_and_revert_keep_settings_and_share_state():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None), nn.Flatten(),
                          nn.BatchNorm1d(4 * 30 * 30, affine=False, track_running_stats=False))
    converted = GlobalSyncBatchNorm().apply(model)
    assert isinstance(converted[1], GlobalBatchNorm) and isinstance(converted[3], GlobalBatchNorm)
    assert converted[1].momentum is None and converted[3].affine is False and converted[3].running_mean is None
    assert converted[1].weight is model[1].weight and converted[1].running_var is model[1].running_var
    x = torch.randn(5, 3, 32, 32)
    reverted_ref = [type(m) for m in GlobalSyncBatchNorm().revert(GlobalSyncBatchNorm().apply(model))]
    assert reverted_ref[1] is nn.BatchNorm2d and reverted_ref[3] is nn.BatchNorm1d
    # without a process group it is plain BatchNorm
    torch.testing.assert_close(converted(x), nn.Sequential(*GlobalSyncBatchNorm().revert(converted))(x))
