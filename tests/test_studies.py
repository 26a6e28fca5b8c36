"""The three capstones, reduced for CI (few steps, few seeds); the full ones are marked slow."""

"""The three capstones. The reduced runs are the docs registry's (``generated``: the same
execution the site shows); the full-size ones are marked slow (``make test-full``)."""

import json

import pytest

from vae_ddp.cli import main


def _cli(*args) -> int:
    return main([str(a) for a in args])


def _max_diff(r: dict) -> float:
    return max(e["max_abs_param_diff"] for e in r["world_sizes"].values())


def test_equivalence_float64_meets_its_bound(generated):
    r = generated("equivalence")
    assert r["dtype"] == "float64" and r["bound"] == 1e-10 and set(r["world_sizes"]) == {"2", "4"}
    for n, entry in r["world_sizes"].items():
        assert entry["max_abs_param_diff"] <= 1e-10, (n, entry["max_abs_param_diff"])
        assert entry["settings"]["devices"] == int(n) and entry["settings"]["noise"] == "global"
        assert entry["settings"]["sync_bn"] and entry["settings"]["sampler"] == "global"


def test_equivalence_float32_meets_its_bound_with_sgd_and_adam_amplifies_rounding(generated):
    """What breaks the float32 bound is Adam: the same runs with SGD stay at rounding level,
    while Adam's per-parameter normalisation turns rounding-level gradient differences into
    update differences orders of magnitude larger."""
    sgd, adam = generated("equivalence32sgd", "equivalence.json"), generated("equivalence32", "equivalence.json")
    assert sgd["optimizer"] == "sgd" and adam["optimizer"] == "adam" and sgd["dtype"] == adam["dtype"] == "float32"
    assert _max_diff(sgd) <= 1e-5
    assert _max_diff(adam) > 100 * _max_diff(sgd)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, optimizer, bound", [("float64", "adam", 1e-10), ("float32", "sgd", 1e-5)])
def test_equivalence_resnet18(dtype, optimizer, bound, cifar_dir, tmp_path):
    """The report's model, 10 steps at a small global batch (the small model's 100-step runs are
    the registry's full settings, read by the tests above under VAE_DDP_FULL=1)."""
    args = ["--data", "imagefolder", "--data-dir", cifar_dir, "--model", "resnet18", "--steps", 10,
            "--global-batch-size", 16, "--dtype", dtype, "--optimizer", optimizer]
    assert _cli("equivalence", "--world-sizes", 2, 4, *args, "--out", tmp_path) == 0
    r = json.loads((tmp_path / "equivalence.json").read_text())
    assert _max_diff(r) <= bound


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
