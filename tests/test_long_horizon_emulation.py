"""The long-horizon study emulates default DDP noise on one device (SharedNoise). This checks
that the emulation computes what real DDP computes: 2 gloo ranks with BatchNorm over the global
batch (GlooSyncBatchNorm), the global batch dealt in contiguous chunks
(GlobalBatchDistributedSampler) and Lightning's default noise (every rank seeded alike), in
float64, against one device with SharedNoise; and that independent noise does not."""


import pytest
import torch

from vae_ddp.studies.configs import RunSpec
from vae_ddp.studies.launch import launch
from vae_ddp.studies.long_horizon import SharedNoise, train_run


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


@pytest.fixture(scope="module")
def ddp_params(tmp_path_factory):
    spec = RunSpec(config="ddp", devices=2, sync_bn=True, sampler="global", noise="default", dtype="float64",
                   steps=5, global_batch_size=16, data="digits", seeds=[3], save_params=True).validate()
    out = tmp_path_factory.mktemp("ddp")
    launch(spec, out, quiet=True)  # DDP re-runs its command: in its own process tree, never inside pytest
    return torch.load(out / "params-3.pt")["state_dict"]


@pytest.mark.parametrize("noise, agrees", [("shared", True), ("independent", False)])
def test_shared_noise_emulation_is_ddp(ddp_params, noise, agrees):
    spec = RunSpec(config="single", sampler="global", dtype="float64", steps=5, global_batch_size=16,
                   data="digits", seeds=[3], val_every=0).validate()
    model = train_run(spec, 3, noise, world_size=2)["model"]
    diff = _max_diff({k: v.detach() for k, v in model.state_dict().items()}, ddp_params)
    if agrees:
        assert diff <= 1e-10, diff  # float64 rounding of a different summation order
    else:
        assert diff > 1e-6, diff  # the noise alone moves the parameters far above rounding


def test_shared_noise_repeats_one_draw_per_rank():
    torch.manual_seed(0)
    eps = SharedNoise(world_size=4)(torch.zeros(8, 3, dtype=torch.float64))
    assert eps.shape == (8, 3) and eps.dtype == torch.float64
    torch.manual_seed(0)
    e = torch.empty(2, 3, dtype=torch.float64).normal_()  # what each rank draws for its 2 rows
    for r in range(4):
        assert torch.equal(eps[2 * r:2 * r + 2], e)
    with pytest.raises(ValueError):
        SharedNoise(world_size=3)(torch.zeros(8, 3))


def test_long_horizon_rejects_bad_settings_before_training(tmp_path):
    from vae_ddp.errors import UserError
    from vae_ddp.studies.long_horizon import long_horizon

    for kwargs in (dict(num_seeds=2), dict(world_size=1), dict(global_batch_size=15), dict(margin_sd=0)):
        with pytest.raises(UserError):
            long_horizon(tmp_path, **(dict(data="digits") | kwargs))
    assert not (tmp_path / "runs").exists()
