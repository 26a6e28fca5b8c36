"""The three capstones, reduced for CI (few steps, few seeds); the full ones are marked slow."""

import json

import pytest

from vae_ddp.cli import main


def _cli(*args) -> int:
    return main([str(a) for a in args])


def _common(cifar_dir, steps, model="small", gbs=32):
    return ["--data", "imagefolder", "--data-dir", cifar_dir, "--max-samples", "1200", "--model", model,
            "--steps", steps, "--global-batch-size", gbs]


@pytest.mark.parametrize("dtype, bound", [("float64", 1e-10), ("float32", 1e-5)])
def test_equivalence_reduced(dtype, bound, cifar_dir, tmp_path):
    assert _cli("equivalence", "--world-sizes", 2, 4, "--dtype", dtype, *_common(cifar_dir, 8),
                "--out", tmp_path) == 0
    r = json.loads((tmp_path / "equivalence.json").read_text())
    assert set(r["world_sizes"]) == {"2", "4"} and r["bound"] == bound
    for n, entry in r["world_sizes"].items():
        assert entry["max_abs_param_diff"] <= bound, (n, entry["max_abs_param_diff"])
        assert entry["settings"]["devices"] == int(n) and entry["settings"]["noise"] == "global"


@pytest.mark.slow
@pytest.mark.parametrize("model, steps, dtype, bound", [
    ("small", 100, "float32", 1e-5), ("small", 100, "float64", 1e-10),
    ("resnet18", 10, "float32", 1e-5), ("resnet18", 10, "float64", 1e-10)])
def test_equivalence_full(model, steps, dtype, bound, cifar_dir, tmp_path):
    args = ["--data", "imagefolder", "--data-dir", cifar_dir, "--model", model, "--steps", steps,
            "--global-batch-size", 64 if model == "small" else 16, "--dtype", dtype]
    assert _cli("equivalence", "--world-sizes", 2, 4, *args, "--out", tmp_path) == 0
    r = json.loads((tmp_path / "equivalence.json").read_text())
    assert all(e["max_abs_param_diff"] <= bound for e in r["world_sizes"].values())


def test_ablation_reduced(cifar_dir, tmp_path):
    assert _cli("ablation", "--dtype", "float64", *_common(cifar_dir, 6), "--out", tmp_path) == 0
    v = json.loads((tmp_path / "ablation.json").read_text())["variants"]
    assert v["all fixes"]["max_abs_param_diff"] <= 1e-10
    for name in ("noise back to default", "BatchNorm back to per-rank", "sampler back to DistributedSampler",
                 "Lightning defaults (no fix)"):
        assert v[name]["max_abs_param_diff"] > 1e-8, name  # each factor alone breaks the equivalence
    # logging changes what is seen, not what is trained
    assert v["logging back to rank 0"]["max_abs_param_diff"] <= 1e-10
    assert abs(v["logging back to rank 0"]["logged_kl_diff"]) > 0


def test_seed_study_reduced(cifar_dir, tmp_path):
    assert _cli("seeds", "--num-seeds", 3, "--configs", "single", "ddp", "ddp+fixed", "dp",
                *_common(cifar_dir, 6), "--out", tmp_path) == 0
    r = json.loads((tmp_path / "seeds.json").read_text())
    assert (tmp_path / "seeds.png").stat().st_size > 10_000
    assert r["configs"] == ["single", "ddp", "ddp+fixed", "dp"]
    for c in ("ddp", "ddp+fixed", "dp"):
        for q in ("train_kl", "train_recon_loss", "val_kl", "val_recon_loss"):
            e = r["summary"][c][q]
            w = e["vs_single"]
            assert len(e["values"]) == 3 and 0 <= w["p"] <= 1
            assert w["ci_low"] <= w["diff"] <= w["ci_high"]
            assert w["diff"] == pytest.approx(e["mean"] - r["summary"]["single"][q]["mean"])
    # seeds differ: the study measures run-to-run spread, not one run three times
    assert r["summary"]["single"]["val_kl"]["std"] > 0


def test_welch_matches_scipy_and_textbook_interval():
    import scipy.stats as sps

    from vae_ddp.stats import welch

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
