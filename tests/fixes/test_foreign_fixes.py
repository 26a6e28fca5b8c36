"""The fixes on models that are not the project's VAE: faults found by reducing public
reports of "DDP does not match one device" to small LightningModules.

Unit-level checks run here in one process (ranks simulated by giving ``rank`` and
``world_size`` explicitly); the DDP runs (2 gloo processes through Lightning) are the
examples the documentation shows, read through ``generated`` (conftest.py).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from vae_ddp.fixes import (GlobalBatchDistributedSampler, GlobalBatchDropout, GlobalBatchNoise, GlobalBatchRandomness,
                           GlobalBatchStream, SeededAugmentation, global_batch_draw, global_item_mean,
                           global_token_cross_entropy, padded_duplicates, unrepeated_sampler)


@pytest.fixture
def global_seed(monkeypatch):
    """``set(seed)``: what ``seed_everything(seed)`` exports, undone after the test."""
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    return lambda seed: monkeypatch.setenv("PL_GLOBAL_SEED", str(seed))


# --------------------------------------------------------------------------- fault 1, 2: the sampler

def test_sampler_seeds_from_seed_everything(global_seed):
    """Fault 1: two runs seeded 1 and 2 shuffled identically (seed defaulted to 0)."""
    ds = list(range(100))
    global_seed(1)
    one = list(GlobalBatchDistributedSampler(ds, 10, num_replicas=1, rank=0))
    one_again = list(GlobalBatchDistributedSampler(ds, 10, num_replicas=1, rank=0))
    global_seed(2)
    two = list(GlobalBatchDistributedSampler(ds, 10, num_replicas=1, rank=0))
    assert one == one_again  # same seed, same order
    assert one != two  # different seeds, different orders
    assert one == torch.randperm(100, generator=torch.Generator().manual_seed(1)).tolist()
    assert list(GlobalBatchDistributedSampler(ds, 10, num_replicas=1, rank=0, seed=1)) == one  # explicit wins
    assert GlobalBatchDistributedSampler(ds, 10, num_replicas=1, rank=0, seed=7).seed == 7


def test_sampler_without_process_group_is_one_replica(global_seed):
    """Fault 2: ``GlobalBatchDistributedSampler(dataset, B)`` raised "Default process group has
    not been initialized" on one device."""
    assert not torch.distributed.is_initialized()
    s = GlobalBatchDistributedSampler(list(range(50)), 16)
    assert (s.num_replicas, s.rank, len(s)) == (1, 0, 48)
    first = list(s)
    s.set_epoch(1)
    assert sorted(first) != first and list(s) != first and len(set(list(s))) == 48
    loader = DataLoader(list(range(50)), batch_size=16, sampler=GlobalBatchDistributedSampler(list(range(50)), 16))
    assert [len(b) for b in loader] == [16, 16, 16]
    with pytest.raises(ValueError, match="needs rank"):
        GlobalBatchDistributedSampler(list(range(50)), 16, num_replicas=2)


def test_global_sampler_datamodule_follows_seed_everything(global_seed):
    from vae_ddp.data import DigitsDataModule

    orders = []
    for seed in (1, 2, 1):
        global_seed(seed)
        dm = DigitsDataModule(batch_size=16, sampler="global", max_samples=200)
        dm.setup()
        orders.append(list(dm.train_dataloader().sampler))
    assert orders[0] == orders[2] != orders[1]


# --------------------------------------------------------------------------- the mechanism

@pytest.mark.parametrize("world", [2, 4])
def test_stream_rows_of_the_ranks_make_the_one_device_draw(world):
    b = 3
    single = GlobalBatchStream(seed=5, rank=0, world_size=1).start(7)
    ref = [single.draw(torch.randn, (world * b, 4), torch.float64), single.draw(torch.rand, (world * b, 2, 3))]
    single.stop()
    for r in range(world):
        s = GlobalBatchStream(seed=5, rank=r, world_size=world).start(7)
        got = [s.draw(torch.randn, (b, 4), torch.float64), s.draw(torch.rand, (b, 2, 3))]
        s.stop()
        assert torch.equal(got[0], ref[0][r * b:(r + 1) * b]) and torch.equal(got[1], ref[1][r * b:(r + 1) * b])
    seq_first = GlobalBatchStream(seed=5, rank=1, world_size=2).start(7)
    t = seq_first.draw(torch.rand, (6, b, 2), batch_dim=1)  # (T, b, E)
    seq_first.stop()
    one = GlobalBatchStream(seed=5, rank=0, world_size=1).start(7)
    full = one.draw(torch.rand, (6, 2 * b, 2), batch_dim=1)
    one.stop()
    assert torch.equal(t, full[:, b:])


def test_global_batch_draw_outside_a_step_is_a_plain_draw():
    torch.manual_seed(3)
    a = global_batch_draw(torch.rand, (2, 3))
    torch.manual_seed(3)
    assert torch.equal(a, torch.rand(2, 3))


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 8), nn.Dropout(0.2),
                                 nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x)


def _one_device_and_two_ranks(model: nn.Module, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``model(x)`` under a one-device stream, and the two halves of ``x`` under 2 simulated
    ranks' streams, concatenated."""
    s = GlobalBatchStream(seed=seed, rank=0, world_size=1).start(0)
    ref = model(x)
    s.stop()
    parts, b = [], len(x) // 2
    for r in range(2):
        s = GlobalBatchStream(seed=seed, rank=r, world_size=2).start(0)
        parts.append(model(x[b * r:b * (r + 1)]))
        s.stop()
    return ref, torch.cat(parts)


def test_global_batch_dropout_gives_each_rank_the_rows_of_the_one_device_mask():
    """Fault 4's mechanism: the swapped model on 2 simulated ranks computes exactly the
    one-device outputs (float64), while nn.Dropout with the same seed on each rank repeats
    rank 0's masks."""
    x = torch.randn(8, 5, dtype=torch.float64)
    model = _MLP().double().train()
    swapped = GlobalBatchDropout.swap(model)
    assert [type(m).__name__ for m in model.net] == ["Linear", "ReLU", "GlobalBatchDropout", "Linear",
                                                    "GlobalBatchDropout", "Linear"]
    ref, ranks = _one_device_and_two_ranks(model, x, seed=11)
    assert torch.equal(ranks, ref)
    GlobalBatchDropout.unswap(swapped)
    assert all(type(m) is nn.Dropout for m in (model.net[2], model.net[4]))
    # default dropout, each rank seeded alike: rank 1's masks are rank 0's
    masks = []
    for r in range(2):
        torch.manual_seed(0)
        masks.append(nn.functional.dropout(torch.ones(4, 8), 0.5, training=True))
    assert torch.equal(masks[0], masks[1])


def test_global_batch_drop_path_gives_each_rank_the_rows_of_the_one_device_draw():
    """Drop-path (stochastic depth, timm's ViT and torchvision's ConvNeXt/Swin/EfficientNet):
    swapped, 2 simulated ranks compute the one-device outputs; outside a stream, in eval mode
    and after unswap it is the original layer; torchvision's mode="batch" (one draw for the
    whole batch) is left alone."""
    from torchvision.ops import StochasticDepth

    from vae_ddp.fixes import GlobalBatchDropPath
    from vae_ddp.fixes.dropout import drop_path_layers

    torch.manual_seed(0)  # the same weights and input whatever ran before in this process
    model = nn.Sequential(nn.Linear(5, 5), StochasticDepth(0.5, "row"), StochasticDepth(0.5, "batch")).double().train()
    x = torch.randn(8, 5, dtype=torch.float64)
    swapped = GlobalBatchDropPath.swap(model)
    assert [type(m).__name__ for m in model] == ["Linear", "GlobalBatchDropPath", "StochasticDepth"]
    assert drop_path_layers(model) == []
    model[2].eval()  # the batch-mode layer out of the way
    ref, ranks = _one_device_and_two_ranks(model, x, seed=5)
    kept = (ref != 0).all(1)
    assert 0 < kept.sum() < 8 and torch.allclose(ref[kept], 2 * model[0](x)[kept])  # kept rows scaled by 1/(1-p)
    # the same rows dropped; the kept rows' values within rounding (a matrix product of 4 rows can round
    # otherwise than one of 8: it once differed in a last bit, depending on what drew from the generator before)
    assert torch.equal(ranks == 0, ref == 0)
    torch.testing.assert_close(ranks, ref, rtol=0, atol=1e-14)
    torch.manual_seed(0)
    plain = model(x)  # no stream: the original layer's own draw
    torch.manual_seed(0)
    assert torch.equal(plain, StochasticDepth(0.5, "row")(model[0](x)))
    GlobalBatchDropout.unswap(swapped)
    assert type(model[1]) is StochasticDepth


def test_global_batch_dropout_keeps_dropout_semantics():
    d = GlobalBatchDropout(0.25).train()
    s = GlobalBatchStream(seed=0, rank=0, world_size=1).start(0)
    y = d(torch.ones(200, 100, dtype=torch.float64))
    s.stop()
    kept = (y != 0).double().mean()
    assert abs(float(kept) - 0.75) < 0.01 and torch.allclose(y[y != 0], torch.full_like(y[y != 0], 1 / 0.75))
    assert torch.equal(d.eval()(torch.ones(3, 4)), torch.ones(3, 4))
    channel = GlobalBatchDropout(0.5, kind=nn.Dropout2d).train()
    s = GlobalBatchStream(seed=0, rank=0, world_size=1).start(0)
    z = channel(torch.ones(4, 6, 3, 3))
    s.stop()
    assert all(len(set(z[i, c].flatten().tolist())) == 1 for i in range(4) for c in range(6))
    with pytest.raises(ValueError, match="kind must be one of"):
        GlobalBatchDropout(0.1, kind=nn.AlphaDropout)


# --------------------------------------------------------------------------- fault 3: warnings, leftovers

def _fit_one_device(module, callbacks, steps=2):
    import pytorch_lightning as pl

    from vae_ddp.utils import quiet

    quiet()
    data = DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 5), torch.randn(16, 1)), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data)
    return [str(w.message) for w in caught if "Global" in str(w.message)]


def _regressor(p: float):
    import pytorch_lightning as pl

    class Regressor(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(5, 8), nn.Dropout(p), nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Regressor()


def test_global_batch_noise_on_a_dropout_module_warns_and_leaves_no_attribute():
    """Fault 3: GlobalBatchNoise on a module whose randomness is nn.Dropout changed nothing,
    said nothing, and left a ``noise`` attribute on the module."""
    module = _regressor(0.1)
    messages = _fit_one_device(module, [GlobalBatchNoise(0)])
    assert any("cannot serve the random draws of net.1 (Dropout)" in m for m in messages), messages
    assert any("never drew from it" in m and "GlobalBatchRandomness" in m for m in messages), messages
    assert "noise" not in module.__dict__ and not hasattr(module, "noise")
    assert type(module.net[1]) is nn.Dropout


def test_global_batch_randomness_swaps_dropout_during_fit_only_and_is_silent_when_used():
    module = _regressor(0.1)
    seen = []

    import pytorch_lightning as pl

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(type(pl_module.net[1]).__name__)

    messages = _fit_one_device(module, [GlobalBatchRandomness(0), Spy()])
    assert seen == ["GlobalBatchDropout", "GlobalBatchDropout"] and messages == []
    assert type(module.net[1]) is nn.Dropout and not hasattr(module, "noise")


def test_global_batch_noise_keeps_the_vae_noise_and_its_values():
    from vae_ddp.model import VAE, standard_normal_noise

    model = VAE(enc_type="small", latent_dim=4)
    noise = GlobalBatchNoise(3)
    g = torch.Generator().manual_seed(3 * 1_000_003 + 0)
    assert torch.equal(noise(torch.zeros(6, 4)), torch.randn(6, 4, generator=g))  # batch 0, one device
    stream_draws = []

    import pytorch_lightning as pl

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            stream_draws.append(pl_module.noise is noise)

    dm_data = DataLoader(torch.utils.data.TensorDataset(torch.rand(8, 3, 32, 32)), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[noise, Spy()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, dm_data)
    assert stream_draws == [True, True]
    assert model.noise is standard_normal_noise
    assert not [w for w in caught if "GlobalBatchNoise" in str(w.message)]


# --------------------------------------------------------------------------- augmentation with workers

def _augment(x):
    """A random transform on torch's global generator: flip with probability 1/2, plus noise."""
    if torch.rand(()) < 0.5:
        x = x.flip(-1)
    return x + 0.1 * torch.randn_like(x)


class _Ones(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.arange(4, dtype=torch.float64) + i, i


def _augmented(dataset, world, rank, workers, seed_main=0):
    torch.manual_seed(seed_main)  # seed_everything: the same on every rank
    sampler = GlobalBatchDistributedSampler(dataset, 8, num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(dataset, batch_size=8 // world, sampler=sampler, num_workers=workers)
    return {int(i): x for xb, ib in loader for x, i in zip(xb, ib)}


def test_seeded_augmentation_is_the_same_on_any_world_size_and_workers():
    """Each sample gets the one-device augmentation on 2 ranks with 2 workers each (and
    another one at the next epoch), where the plain transform repeats rank 0's draws on rank 1."""
    aug = SeededAugmentation(_Ones(), _augment, seed=4)
    single = _augmented(aug, 1, 0, 0)
    ranks = {}
    for r in range(2):
        ranks.update(_augmented(aug, 2, r, 2))
    assert sorted(ranks) == sorted(single) == list(range(24))
    assert all(torch.equal(ranks[i], single[i]) for i in single)
    aug.set_epoch(1)
    assert not torch.equal(_augmented(aug, 1, 0, 2)[0], single[0])

    class Plain(_Ones):
        def __getitem__(self, i):
            return torch.rand(5, dtype=torch.float64), i  # what a random transform draws

    per_rank = [_augmented(Plain(), 2, r, 2) for r in range(2)]
    draws = [torch.stack(list(d.values())) for d in per_rank]  # in the order each rank loaded them
    assert torch.equal(draws[0], draws[1])  # rank 1 draws exactly what rank 0 draws


# --------------------------------------------------------------------------- item counts, evaluation

def test_item_mean_without_process_group_is_the_mean():
    logits = torch.randn(10, 5, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([1, 2, -100, 0, 4, -100, -100, 3, 3, 1])
    ours = global_token_cross_entropy(logits, target)
    torch.testing.assert_close(ours, nn.functional.cross_entropy(logits, target, ignore_index=-100), rtol=1e-15,
                               atol=0)
    with pytest.raises(ValueError, match="global count 0"):
        global_item_mean(torch.tensor(1.0), 0)


@pytest.mark.parametrize("n", [1, 2, 5, 100, 101, 103])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_unrepeated_sampler_covers_each_sample_once(n, world):
    if n < world:
        with pytest.raises(ValueError, match="smaller than the world size"):
            unrepeated_sampler(list(range(n)), world, 0)
        return
    seen = sorted(i for r in range(world) for i in unrepeated_sampler(list(range(n)), world, r))
    assert seen == list(range(n))
    padded = sorted(i for r in range(world) for i in torch.utils.data.DistributedSampler(
        list(range(n)), world, r, shuffle=False))
    assert len(padded) - n == padded_duplicates(n, world)
    assert len(unrepeated_sampler(list(range(n)))) == n  # no process group: one replica


def test_env_without_seed_everything(global_seed):
    assert GlobalBatchStream().seed == 0
    global_seed("x")
    with pytest.raises(ValueError, match="PL_GLOBAL_SEED='x' is not an integer"):
        GlobalBatchStream()
    os.environ.pop("PL_GLOBAL_SEED")


# --------------------------------------------------------------------------- DDP runs (the examples)

def test_dropout_model_reaches_the_float64_floor_with_global_batch_randomness(generated):
    """Fault 4: a transformer-like model with dropout 0.1 (and random augmentation, 2 workers)
    stayed far from one device in float64 with every fix on; with GlobalBatchRandomness and
    SeededAugmentation it reaches the floor of the same model without any random draw."""
    r = generated("dropout_ddp")
    floor = r["floor"]["max_abs_param_diff"]
    assert floor < 1e-10  # float64: DDP's rounding only
    assert r["default"]["max_abs_param_diff"] > 1e-3
    assert r["fixed"]["max_abs_param_diff"] < max(10 * floor, 1e-11)


def test_token_mean_first_gradient_is_one_devices_with_the_all_reduced_count(generated):
    """Fault 5: a mean over tokens (ignore_index=-100) under DDP with equal per-rank batches."""
    r = generated("token_mean_ddp")
    a, b = r["tokens_per_rank_step0"]
    assert a != b  # equal batch sizes, unequal token counts
    assert r["one_device_helper_vs_mean"] == 0.0  # without a process group the helper is the plain mean
    assert r["per_rank_mean"]["grad_rel_diff"] > 1e-3
    assert r["global_mean"]["grad_rel_diff"] < 1e-13  # float64 rounding
    assert r["global_mean"]["logged_loss_abs_diff"] < 1e-14 < r["per_rank_mean"]["logged_loss_abs_diff"]


def test_validation_counts_each_sample_once_and_matches_one_device_exactly(generated):
    """Fault 6: 101 validation samples on 2 ranks counted 102 and the accuracy was off."""
    r = generated("unpadded_validation")
    n = r["samples"]
    assert n == 101 and r["one_device"]["samples"] == n
    assert r["one_device"]["accuracy"] == pytest.approx(r["correct"] / n, rel=1e-7)
    assert r["default"]["samples"] == n + padded_duplicates(n, 2) == 102
    assert r["default"]["abs_diff_vs_one_device"] > 1e-3
    assert r["unrepeated"]["samples"] == n and r["unrepeated"]["abs_diff_vs_one_device"] > 1e-3
    # not the ranks' weighting: Lightning averages the ranks' sample counts (51 + 50) in an
    # integer tensor, 50.5 becomes 50 (Lightning issues #21838, #21859)
    assert r["unrepeated"]["accuracy"] == pytest.approx(r["one_device_exact"] * (n / 2) / (n // 2), rel=1e-12)
    assert r["fixed"]["samples"] == n and r["fixed"]["accuracy"] == r["one_device"]["accuracy"]


def test_every_fix_is_exported_from_the_package():
    import vae_ddp
    import vae_ddp.fixes

    assert set(vae_ddp.fixes.__all__) <= set(vae_ddp.__all__)
    assert all(getattr(vae_ddp, name) is getattr(vae_ddp.fixes, name) for name in vae_ddp.fixes.__all__)


def test_augmentation_epoch_reaches_datasets_inside_lightning_loaders():
    from pytorch_lightning.utilities import CombinedLoader
    from torch.utils.data import ConcatDataset, Subset

    from vae_ddp.fixes.augmentation import set_augmentation_epoch

    a, b = SeededAugmentation(_Ones(), _augment), SeededAugmentation(_Ones(), _augment)
    loaders = CombinedLoader({"x": DataLoader(Subset(a, [0, 1])), "y": DataLoader(ConcatDataset([b, _Ones()]))})
    assert set_augmentation_epoch(loaders, 3) == 2 and a.epoch == b.epoch == 3
