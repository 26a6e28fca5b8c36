"""The three configurations train on real images through Lightning; a failing rank ends the run."""

import dataclasses
import sys

import pytest
from helpers import ROOT
import torch

from vae_ddp.harness.configs import RunSpec
from vae_ddp.harness.launch import Job, RunFailed, launch, launch_by_world_size


def _spec(cifar_dir, **kw) -> RunSpec:
    base = dict(data="imagefolder", data_dir=str(cifar_dir), max_samples=1200, model="small", steps=12,
                global_batch_size=32, devices=2, lr=1e-3, seeds=[0])
    base.update(kw)
    return RunSpec(**base).validate()


@pytest.fixture(scope="module")
def one_process(cifar_dir, tmp_path_factory) -> dict[str, dict]:
    """single, dp and single again, one after the other in one process (a group of a job, as the
    studies launch them): {label: run}."""
    specs = [_spec(cifar_dir, config="single"), _spec(cifar_dir, config="dp"),
             _spec(cifar_dir, config="single", label="single again")]
    group = launch_by_world_size(specs, tmp_path_factory.mktemp("group"), quiet=True)
    assert len({where for _, where in group}) == 1  # one world size: one group
    return {g["spec"]["label"]: g["runs"][0] for g, _ in group}


def test_a_group_leaks_nothing_from_one_run_into_the_next(one_process):
    """The same spec trained before and after another run in the same process: the same
    records, bit for bit (seeding, samplers and fixes are per run)."""
    first, again = one_process["single"], one_process["single again"]
    keys = ("loss", "kl", "recon_loss")
    assert [[r[k] for k in keys] for r in first["records"]] == [[r[k] for k in keys] for r in again["records"]]


def test_a_group_needs_one_world_size(cifar_dir):
    with pytest.raises(ValueError, match="one world size"):
        Job({"mixed": [_spec(cifar_dir, config="single"), _spec(cifar_dir, config="ddp")]})


@pytest.mark.parametrize("config", ["single", "ddp", "dp"])
def test_configuration_trains_on_real_cifar(config, cifar_dir, tmp_path, request):
    spec = _spec(cifar_dir, config=config)
    if config == "ddp":
        run = launch_by_world_size([spec], tmp_path, quiet=True)[0][0]["runs"][0]
    else:
        run = request.getfixturevalue("one_process")[spec.label]
    losses = [r["loss"] for r in run["records"]]
    assert len(losses) == spec.steps
    assert all(r["global_batch_size"] == 32 for r in run["records"])
    assert all(torch.isfinite(torch.tensor(losses)))
    third = spec.steps // 3
    assert sum(losses[-third:]) / third < 0.8 * sum(losses[:third]) / third


def test_ddp_step_value_is_the_global_batch_mean(cifar_dir, tmp_path):
    """The value recorded for a DDP step is the mean over the whole global batch: with BatchNorm
    over the global batch and the global-batch noise, it equals one process computing the loss
    of the same 32 samples at the initial weights (step 1 is recorded before the update)."""
    import pytorch_lightning as pl

    from vae_ddp.data import make_datamodule
    from vae_ddp.fixes.noise import GlobalBatchNoise
    from vae_ddp.fixes.sampler import GlobalBatchDistributedSampler
    from vae_ddp.harness.runner import build_model

    spec = dataclasses.replace(_spec(cifar_dir, config="ddp", steps=1).exact(), dtype="float64")
    rec = launch_by_world_size([spec], tmp_path, quiet=True)[0][0]["runs"][0]["records"][0]

    pl.seed_everything(0, verbose=False)
    model = build_model(spec, 0).double()
    dm = make_datamodule(spec.data, spec.data_dir, batch_size=32, max_samples=spec.max_samples)
    dm.setup()
    idx = list(GlobalBatchDistributedSampler(dm.dataset_train, 32, num_replicas=1, rank=0, seed=0))[:32]
    x = torch.stack([dm.dataset_train[i][0] for i in idx]).double()
    noise = GlobalBatchNoise(0)  # batch 0, world size 1: the rows both ranks sliced
    _, logs = model.step(x, noise(torch.zeros(32, spec.latent_dim, dtype=torch.float64)))
    for k in ("recon_loss", "kl", "loss"):
        assert rec[k] == pytest.approx(float(logs[k].detach()), rel=1e-10, abs=1e-14)
    # what Lightning logged on rank 0 (sync_dist=True in the exact spec) is the same mean
    assert rec["logged_loss"] == pytest.approx(float(logs["loss"].detach()), rel=1e-10)


def test_a_failing_rank_ends_the_whole_run(cifar_dir, tmp_path):
    spec = _spec(cifar_dir, config="ddp", steps=10)
    script = ROOT / "tests" / "scripts" / "failing_rank.py"
    with pytest.raises(RunFailed) as err:
        launch(Job({"ddp": [spec]}), tmp_path, quiet=True, timeout=300, entry=[sys.executable, str(script)])
    assert "rank 1 exploded on purpose" in str(err.value)
    assert "exited with code" in str(err.value)  # ended by itself, not by our timeout


def test_a_run_starts_from_the_weights_of_init_weights(cifar_dir, tmp_path):
    """``init_weights``: the first step starts from the file's weights (every key), not the seed's."""
    from vae_ddp.model import VAE

    torch.manual_seed(123)
    other = VAE(input_height=32, enc_type="small", latent_dim=32).state_dict()
    torch.save({"state_dict": other, "adam_v": {}}, tmp_path / "w.pt")
    spec = _spec(cifar_dir, config="single", steps=1, init_weights=str(tmp_path / "w.pt"),
                 steps_file=str(tmp_path / "steps.pt"))
    launch_by_world_size([spec], tmp_path / "out", quiet=True)
    first = torch.load(tmp_path / "steps.pt")["states"][0]
    assert set(first) == set(other)
    assert all(torch.equal(first[k], other[k]) for k in other)
    seeded = _spec(cifar_dir, config="single", steps=1).meta_model()  # shapes only: the seed's draw differs
    assert set(seeded.state_dict()) == set(other)


def test_init_weights_that_do_not_fit_are_one_line_before_any_run(cifar_dir, tmp_path):
    from vae_ddp.errors import UserError
    from vae_ddp.model import VAE

    torch.save(VAE(input_height=32, enc_type="small", latent_dim=16).state_dict(), tmp_path / "w.pt")
    fit = r"does not fit --model small \(latent 32\): \S+ is \(2048, 16\) in the file, \(2048, 32\) in the model"
    with pytest.raises(UserError, match=fit):
        _spec(cifar_dir, init_weights=str(tmp_path / "w.pt"))
    with pytest.raises(UserError, match="no such file"):
        _spec(cifar_dir, init_weights=str(tmp_path / "none.pt"))
