"""DDPAudit on a foreign module under real 2-rank DDP (gloo): what it finds and what it does not."""

import json
import sys

import pytest

from vae_ddp import guard
from helpers import ROOT


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """Both modes of the script, in one launch: the findings of each, by factor."""
    out = tmp_path_factory.mktemp("callback")
    proc = guard.run([sys.executable, str(ROOT / "tests" / "scripts" / "audit_callback.py"), str(out), "exposed",
                      "clean"], capture_output=True, text=True, timeout=300, cwd=out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found: dict = {}
    for mode in ("exposed", "clean"):
        found[mode] = {}
        for f in json.loads((out / f"{mode}.json").read_text()):
            found[mode].setdefault(f["factor"], []).append(f)
    return found


def test_exposed_module(fitted):
    found = fitted["exposed"]
    # SGD has no per-parameter step sizes: the shared noise changes no optimizer state (no "optimizer" row)
    assert set(found) == {"noise", "batchnorm", "sampler", "reduction", "logging"}
    assert "1 BatchNorm layer" in found["batchnorm"][0]["evidence"]
    assert "train: 1 repeated of 101" in found["reduction"][0]["evidence"]
    unsynced, epoch_mean = found["logging"]  # after the first batch; at the end of the validation epoch
    assert "train_loss" in unsynced["evidence"]
    # a constant logged without sync_dist is the same value on every rank: nothing to synchronise
    assert "kl_weight" not in unsynced["evidence"] and "1 metric(s)" in unsynced["evidence"]
    # 51 + 50 samples: Lightning's integer average of the counts is 50, the epoch mean 101/100 of the true one
    assert "51, 50 samples" in epoch_mean["evidence"] and "1.01x the true mean" in epoch_mean["evidence"]
    assert "val_loss" in epoch_mean["evidence"] and "MeanMetric" in epoch_mean["fix"]
    assert all(f["page"].endswith(".md") for fs in found.values() for f in fs)


def test_clean_module(fitted):
    assert fitted["clean"] == {}


def test_loader_batch_against_the_sampler():
    """DataLoader(batch_size=B) over GlobalBatchDistributedSampler(ds, B) on 2 ranks trains
    with a global batch of 2B: the sampler factor's watch says so at the start of training
    (checked without a process group, through the registry as DDPAudit calls it)."""
    from types import SimpleNamespace

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from vae_ddp.fixes import GlobalBatchDistributedSampler, registry
    from vae_ddp.fixes.factor import Seen

    ds = TensorDataset(torch.randn(64, 8))
    sampler = GlobalBatchDistributedSampler(ds, 16, num_replicas=2, rank=0)
    watch = dict(registry.watchers("train_start"))["sampler"]
    for batch_size, flagged in ((16, True), (8, False)):
        trainer = SimpleNamespace(train_dataloader=DataLoader(ds, batch_size=batch_size, sampler=sampler),
                                  val_dataloaders=None)
        findings = watch(Seen(trainer, None))
        found = [f for f in findings if "per step" in f.evidence]
        assert bool(found) == flagged, findings
        if flagged:
            assert found[0].factor == "sampler" and "a global batch of 32, not 16" in found[0].evidence
            assert "batch_size=8" in found[0].fix


def test_optimizer_row_only_for_per_parameter_step_sizes():
    """The optimizer factor names the user's optimizer class, and only one with per-parameter step
    sizes (Adam's kin, RMSprop, Adagrad; a third-party one by its state once it has stepped); SGD,
    with momentum too, steps along the all-reduced gradient itself."""
    import torch

    from vae_ddp.fixes.optimizer import adaptive

    p = [torch.nn.Parameter(torch.ones(2))]
    assert adaptive([torch.optim.SGD(p, lr=0.1), torch.optim.SGD(p, lr=0.1, momentum=0.9)]) == []
    assert adaptive([torch.optim.AdamW(p), torch.optim.RMSprop(p), torch.optim.SGD(p, lr=0.1)]) == ["AdamW", "RMSprop"]

    class Custom(torch.optim.Optimizer):  # keeps Adam's statistic under Adam's name
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        def step(self, closure=None):
            for q in self.param_groups[0]["params"]:
                self.state[q]["exp_avg_sq"] = q.grad ** 2

    custom = Custom(p)
    assert adaptive([custom]) == []  # not stepped yet: nothing to tell it from SGD
    p[0].grad = torch.ones(2)
    custom.step()
    assert adaptive([custom]) == ["Custom"]
