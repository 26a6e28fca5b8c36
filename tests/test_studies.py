"""The studies (equivalence, ablation, seeds). The reduced runs are the docs registry's (``generated``: the same
execution the site shows); the full-size ones are marked slow (``make test-full``)."""

import json
from types import SimpleNamespace

import pytest
import torch

from vae_ddp.cli import main
from vae_ddp.studies.equivalence import FLOOR_FACTOR, WithinBatchPermutation, verdict


def _cli(*args) -> int:
    return main([str(a) for a in args])


def _max_diff(r: dict) -> float:
    return max(e["max_abs_param_diff"] for e in r["world_sizes"].values())


def _check_floor(r: dict, dtype: str, optimizer: str) -> None:
    """What every equivalence.json must show: the floor measured in the same run, and each
    world size within FLOOR_FACTOR of it, with the verdict worded from that ratio."""
    assert r["dtype"] == dtype and r["optimizer"] == optimizer and set(r["world_sizes"]) == {"2", "4"}
    assert len(r["floor_runs"]) >= 4 and r["floor"] == max(r["floor_runs"]) > 0
    for n, e in r["world_sizes"].items():
        assert e["ratio_to_floor"] == pytest.approx(e["max_abs_param_diff"] / r["floor"])
        assert e["ratio_to_floor"] <= FLOOR_FACTOR, (n, e["ratio_to_floor"], e["worst_params"])
        assert e["within_floor"] and e["verdict"] == verdict(e["ratio_to_floor"])
        assert e["settings"]["devices"] == int(n) and e["settings"]["noise"] == "global"
        assert e["settings"]["sync_bn"] and e["settings"]["sampler"] == "global"
    assert r["summary"].startswith(f"{dtype}, {optimizer}: DDP at world size 2, 4 matches one device")


def test_equivalence_float64_within_the_one_device_floor(generated):
    r = generated("equivalence")
    _check_floor(r, "float64", "adam")
    assert r["floor"] < 1e-9  # float64: reordering moves the parameters by rounding only


@pytest.mark.parametrize("name, optimizer", [("equivalence32", "adam"), ("equivalence32sgd", "sgd")])
def test_equivalence_float32_within_the_one_device_floor(generated, name, optimizer):
    _check_floor(generated(name, "equivalence.json"), "float32", optimizer)


def test_adam_amplifies_the_float32_floor(generated):
    """The floor itself depends on the optimizer: Adam divides each step by the root of a
    running second moment, which turns rounding-level gradient differences into step
    differences far larger than SGD carries."""
    sgd, adam = generated("equivalence32sgd", "equivalence.json"), generated("equivalence32", "equivalence.json")
    assert adam["floor"] > 10 * sgd["floor"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype, optimizer", [("float64", "adam"), ("float32", "sgd")])
def test_equivalence_resnet18(dtype, optimizer, cifar_dir, tmp_path):
    """The report's model, 10 steps at a small global batch (the small model's 100-step runs are
    the registry's full settings, read by the tests above under VAE_DDP_FULL=1)."""
    args = ["--data", "imagefolder", "--data-dir", cifar_dir, "--model", "resnet18", "--steps", 10,
            "--global-batch-size", 16, "--dtype", dtype, "--optimizer", optimizer]
    assert _cli("equivalence", "--world-sizes", 2, 4, *args, "--out", tmp_path) == 0
    _check_floor(json.loads((tmp_path / "equivalence.json").read_text()), dtype, optimizer)


class _NoisyModule(torch.nn.Module):
    def noise(self, mu):
        return torch.arange(len(mu), dtype=mu.dtype)[:, None].expand_as(mu) + 100


def test_within_batch_permutation_keeps_each_sample_with_its_noise():
    """The floor's run reorders the batch in place and hands every row the noise its sample
    met unpermuted; the module's own noise comes back after the batch."""
    trainer, module = SimpleNamespace(world_size=1), _NoisyModule()
    x, y = torch.arange(8.0)[:, None].repeat(1, 3), torch.arange(8)
    batch = [x.clone(), y.clone()]
    eps_plain = module.noise(torch.zeros(8, 2))
    cb = WithinBatchPermutation(seed=3)
    cb.on_fit_start(trainer, module)
    cb.on_train_batch_start(trainer, module, batch, 0)
    eps = module.noise(torch.zeros(8, 2))
    perm = batch[1]  # labels were 0..7: now the permutation itself
    assert sorted(perm.tolist()) == list(range(8)) and perm.tolist() != list(range(8))
    assert torch.equal(batch[0], x[perm]) and torch.equal(eps, eps_plain[perm])
    cb.on_train_batch_end(trainer, module, None, batch, 0)
    assert "noise" not in module.__dict__ and torch.equal(module.noise(torch.zeros(8, 2)), eps_plain)
    with pytest.raises(RuntimeError, match="one-device"):
        cb.on_train_batch_start(SimpleNamespace(world_size=2), module, [x, y], 1)


def test_ablation_each_factor_breaks_equivalence(generated):
    v = generated("ablation")["variants"]
    assert v["all fixes"]["max_abs_param_diff"] <= 1e-10
    for name in ("noise back to default", "BatchNorm back to per-rank", "sampler back to DistributedSampler",
                 "Lightning defaults (no fix)"):
        assert v[name]["max_abs_param_diff"] > 1e-8, name  # each factor alone breaks the equivalence
    # logging changes what is seen, not what is trained
    assert v["logging back to rank 0"]["max_abs_param_diff"] <= 1e-10
    assert abs(v["logging back to rank 0"]["logged_kl_diff"]) > 0


def test_seed_study(generated):
    r = generated("seeds")
    n = r["num_seeds"]
    assert r["configs"] == ["single", "ddp", "ddp+fixed", "dp"]
    # the page's reading of it (docs/is-it-a-bug.md) must follow from the data
    assert r["verdicts"][0].startswith("ddp: no difference from single detectable")
    for c in ("ddp", "ddp+fixed", "dp"):
        for q in ("train_kl", "train_recon_loss", "val_kl", "val_recon_loss"):
            e = r["summary"][c][q]
            w = e["vs_single"]
            assert len(e["values"]) == n and 0 <= w["p"] <= 1
            assert w["ci_low"] <= w["diff"] <= w["ci_high"]
            assert w["diff"] == pytest.approx(e["mean"] - r["summary"]["single"][q]["mean"])
    # seeds differ: the study measures run-to-run spread, not one run n times
    assert r["summary"]["single"]["val_kl"]["std"] > 0
    assert len(r["verdicts"]) == 3


def test_welch_matches_scipy_and_textbook_interval():
    import scipy.stats as sps

    from vae_ddp.studies.stats import welch

    a, b = [1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 6.0, 8.0, 10.0]
    w = welch(a, b)
    ref = sps.ttest_ind(a, b, equal_var=False)
    assert w["p"] == pytest.approx(ref.pvalue) and w["t"] == pytest.approx(ref.statistic)
    # by hand: diff -3.5; se^2 = (5/3)/4 + 10/5 = 2.41667; Welch-Satterthwaite
    # df = se^4 / ((5/12)^2/3 + 2^2/4) = 5.5208; t_0.975(5.5208) = 2.4993 (t table)
    assert w["diff"] == -3.5 and w["df"] == pytest.approx(5.5208, abs=1e-3)
    assert w["ci_high"] - w["diff"] == pytest.approx(2.4993 * 2.41667**0.5, rel=1e-3)
    with pytest.raises(ValueError):
        welch([1.0], [1.0, 2.0])


def test_committed_full_seed_study_is_what_the_study_renders():
    """docs/results/seeds-full/ is the output folder of the full study shown on the site:
    its table must be the one the study renders from its own seeds.json, at full settings."""
    from conftest import ROOT
    from vae_ddp.studies.seeds import render, verdicts

    folder = ROOT / "docs" / "results" / "seeds-full"
    r = json.loads((folder / "seeds.json").read_text())
    assert (folder / "seeds.md").read_text() == render(r) + "\n"
    assert r["verdicts"] == verdicts(r["summary"])
    assert r["num_seeds"] >= 10 and r["settings"]["steps"] >= 100 and r["settings"]["data"] == "imagefolder"
    assert r["configs"] == ["single", "ddp", "ddp+fixed", "dp"]
    # the page's reading of it (docs/is-it-a-bug.md) must follow from the data
    assert r["verdicts"][0].startswith("ddp: no difference from single detectable")
