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


def _loader_check(context=None):
    """What GlobalSyncBatchNorm's check says of a 2-worker loader (``context``: its start method) in a process
    that runs 2 threads, as a DDP rank does: the warnings raised by the callback that ``apply`` adds."""
    import threading
    import types
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    module = nn.Sequential(nn.BatchNorm2d(2))
    module._trainer = trainer = types.SimpleNamespace(callbacks=[])
    GlobalSyncBatchNorm().apply(module)
    GlobalSyncBatchNorm().apply(module)  # Lightning applies the plugin in every fit: one callback
    assert len(trainer.callbacks) == 1, trainer.callbacks
    trainer.train_dataloader = DataLoader(TensorDataset(torch.zeros(4, 2)), num_workers=2,
                                          multiprocessing_context=context)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)  # a second thread, as gloo's in a rank
    thread.start()
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer.callbacks[0].on_train_start(trainer, module)
    finally:
        stop.set()
        thread.join()
    return [str(w.message) for w in seen]


def test_plugin_warns_when_workers_are_forked_from_a_rank_that_runs_threads():
    """Issue #62, the hang: a DataLoader worker forked from a rank that runs threads (gloo's) can block at start
    (``PyOS_AfterFork_Child``), its rank waits for its batch and the other rank waits in GlobalBatchNorm's
    all_reduce, the step's first collective: the plugin names the condition and the command that avoids it
    (benchmarks/bn_hang.py counts the hangs); a loader with a start method of its own is left alone."""
    import multiprocessing

    default = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    for context in ("fork", None) if default == "fork" else ("fork",):  # None: the default start method
        said = _loader_check(context)
        assert len(said) == 1 and 'multiprocessing_context="forkserver"' in said[0] and "hang" in said[0], said
    assert _loader_check("forkserver") == []


def test_the_batchnorm_page_names_the_hang_and_the_command_the_warning_gives(monkeypatch):
    """docs/factors/batchnorm.md names the condition of the hang (a worker forked from a rank that runs threads,
    blocked in ``PyOS_AfterFork_Child``), the command that avoids it, the same as the plugin's warning, and the
    script that counts the hangs."""
    from torch.utils.data import DataLoader, TensorDataset

    from vae_ddp import workers

    text = (ROOT / "docs" / "factors" / "batchnorm.md").read_text()
    monkeypatch.setattr(workers, "thread_count", lambda: 7)  # a rank: gloo's threads
    monkeypatch.setattr(workers.multiprocessing, "get_start_method", lambda allow_none=False: "fork")
    said = workers.fork_hazard(DataLoader(TensorDataset(torch.zeros(4, 2)), num_workers=2))
    command = 'multiprocessing_context="forkserver"'
    assert said and command in said and "PyOS_AfterFork_Child" in said and "7 threads" in said, said
    assert command in text and "PyOS_AfterFork_Child" in text and "`vae_ddp/fixes/batchnorm.py`" in text
    assert "benchmarks/bn_hang.py" in text and (ROOT / "benchmarks" / "bn_hang.py").exists()


@pytest.mark.parametrize("batch", [16, 13, 1])
def test_every_rank_makes_the_same_collectives_whatever_its_batch_size(monkeypatch, batch):
    """Issue #62: a hang in GlobalBatchNorm's all_reduce is not ranks that call it a different number of times:
    a layer in training makes two all_reduce calls in its forward and one in its backward, whatever the rank's
    batch size (a smaller last batch, ``drop_last=False``), none in eval mode (docs/factors/batchnorm.md)."""
    from vae_ddp.fixes import batchnorm

    calls = []
    monkeypatch.setattr(batchnorm, "_world_size", lambda group: 2)
    monkeypatch.setattr(batchnorm.dist, "all_reduce", lambda t, group=None: calls.append(t.numel()))
    layer = GlobalBatchNorm(4)
    x = torch.randn(batch, 4, 5, 5, requires_grad=True)
    y = layer(x)
    assert calls == [1 + 4, 4], calls  # [count, sum x], then sum (x - mean)**2
    y.sum().backward()
    assert calls[2:] == [2 * 4], calls  # sum dy, sum dy * x_hat
    layer.eval()
    layer(x)
    assert len(calls) == 3
