"""The answer on Home: report-scale study, what was logged (DDP and Lightning 1.x DP), the verdict."""

from __future__ import annotations

import json
import math
import random

import pytest
from conftest import ROOT

REPORT_SCALE = ROOT / "docs" / "results" / "report-scale"


# --------------------------------------------------------------------------- report scale
@pytest.mark.skipif(not (REPORT_SCALE / "report_scale.json").is_file(), reason="report-scale study not committed yet")
def test_committed_report_scale_is_what_the_study_renders():
    """docs/results/report-scale/ is the study's output folder: its tables and command are
    what the study renders from its own JSON, at the report's batch (256 = 2 x 128)."""
    from vae_ddp.studies.report_scale import command_md, ranking, render

    r = json.loads((REPORT_SCALE / "report_scale.json").read_text())
    assert (REPORT_SCALE / "tables.md").read_text() == render(r) + "\n"
    assert (REPORT_SCALE / "command.md").read_text() == command_md(r, "docs/results/report-scale")
    assert (REPORT_SCALE / "report_scale.png").stat().st_size > 10_000
    s = r["settings"]
    assert s["global_batch_size"] == 256 and s["world_size"] == 2 and s["data"] == "imagefolder"
    assert r["ranking"] == ranking(r)
    ratios = [row["ratio"] for row in r["ranking"]]
    assert ratios == sorted(ratios, reverse=True) and all(x > 0 for x in ratios)
    # the page includes exactly these files
    home = (ROOT / "docs" / "index.md").read_text()
    assert '--8<-- "docs/results/report-scale/tables.md"' in home
    assert '--8<-- "docs/results/report-scale/command.md"' in home


def test_report_scale_reduced(generated):
    """The reduced study of the build: with every fix DDP's gradient is one device's up to
    float32 rounding; each factor alone moves it by a sizeable share of the batch noise."""
    r = generated("report_scale")
    v = r["variants"]
    floor = v["ddp, every fix"]["ratio_to_batch_noise"]["all"]
    assert floor < 0.01
    for name in ("ddp, Lightning defaults", "ddp, noise back to default", "ddp, BatchNorm back to per-rank",
                 "ddp, sampler back to DistributedSampler", "dp (emulation of Lightning 1.x DP)"):
        assert v[name]["ratio_to_batch_noise"]["all"] > 10 * floor, name
    assert r["batch_noise"]["all"] > 0 and r["grad_norm"]["all"] > r["batch_noise"]["all"] / 10
    lg = r["logging"]
    assert lg["batches"] == r["settings"]["grad_steps"] + r["settings"]["spread_batches"]
    assert all(a != b for a, b in zip(lg["logged_kl"], lg["global_kl"]))  # rank 0's half is not the batch
    assert r["spread"]["relvar_kl"] > r["spread"]["relvar_recon"]  # the one-sample KL estimate is noisier


def test_report_scale_bad_input_is_one_line(tmp_path):
    from conftest import run_cli

    proc = run_cli("report-scale", "--variants", "nope", "--out", str(tmp_path), timeout=600)
    assert proc.returncode == 2 and "--variants" in proc.stderr and "nope" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = run_cli("report-scale", "--grad-steps", "1", "--out", str(tmp_path), timeout=600)
    assert proc.returncode == 2 and "--grad-steps must be at least 2" in proc.stderr


def test_reduction_arithmetic():
    from vae_ddp.studies.report_scale import _reduction

    # CIFAR-10's 50,000 training images minus bolts' 20% validation = 40,000: 20,000 per rank,
    # last batch 20,000 % 128 = 32 per rank; no padding
    assert _reduction(40_000, 256, 2) == {"train_samples": 40_000, "padded_samples": 0, "per_rank_last_batch": 32,
                                          "single_last_batch": 64, "unequal_steps_per_epoch": 0}
    assert _reduction(1437, 256, 2)["padded_samples"] == 1


# --------------------------------------------------------------------------- what was logged
def test_per_sample_terms_average_to_the_batch_loss():
    import torch

    from vae_ddp.model import VAE
    from vae_ddp.studies.report_scale import per_sample_terms

    torch.manual_seed(0)
    model = VAE(enc_type="small", latent_dim=8).double().train()
    x = torch.rand(16, 3, 32, 32, dtype=torch.float64)
    eps = torch.randn(16, 8, dtype=torch.float64)
    kl, rec = per_sample_terms(model, x, eps)
    _, logs = model.step(x, eps)
    assert float(kl.mean()) == pytest.approx(float(logs["kl"].detach()), rel=1e-12)
    assert float(rec.mean()) == pytest.approx(float(logs["recon_loss"].detach()), rel=1e-12)
    assert kl.shape == rec.shape == (16,) and float(kl.std()) > 0


def test_spread_ratio_and_co_movement():
    from vae_ddp.studies.compare import co_movement, spread_ratio

    rng = random.Random(0)
    glob = [1.0 - 0.01 * k + rng.gauss(0, 0.05) for k in range(400)]
    # a half batch: the global value plus an independent half-batch deviation of the same size
    recs = [{"label": "ddp", "step": k, "kl": g, "logged_kl": g + rng.gauss(0, 0.05)} for k, g in enumerate(glob)]
    assert spread_ratio(recs) == pytest.approx(math.sqrt(2), rel=0.15)
    same = [{"label": "single", "step": k, "kl": g, "logged_kl": g} for k, g in enumerate(glob)]
    assert spread_ratio(same) == 1.0
    assert co_movement(same + [{**r, "label": "dp"} for r in same], "dp") == pytest.approx(1.0)
    other = [{"label": "ddp", "step": k, "kl": 0.0, "logged_kl": rng.gauss(0, 0.05)} for k in range(400)]
    assert abs(co_movement(same + other, "ddp")) < 0.15
    assert spread_ratio(recs[:2]) is None


def test_relative_spread_tells_a_noisy_small_term_from_a_smooth_large_one():
    from vae_ddp.studies.compare import relative_spread

    rng = random.Random(1)
    # a KL-like term: small level, per-step noise half its level; an MSE-like one: large, 1% noise
    kl = [{"logged_kl": 0.012 + rng.gauss(0, 0.006)} for _ in range(500)]
    mse = [{"logged_kl": 0.5 + rng.gauss(0, 0.005)} for _ in range(500)]
    # changes between consecutive independent steps: sqrt(2) x the per-step noise
    assert relative_spread(kl) == pytest.approx(math.sqrt(2) * 0.5, rel=0.1)
    assert relative_spread(mse) == pytest.approx(math.sqrt(2) * 0.01, rel=0.1)
    assert relative_spread(kl[:2]) is None


def test_dp_logs_one_replica_as_lightning_1x_did():
    """Lightning 1.x DP showed one replica's chunk for on_step values (see vae_ddp.studies.dp);
    the emulation logs the last replica's, while it optimises the mean over replicas."""
    import copy

    import pytorch_lightning as pl
    import torch

    from vae_ddp.data import DigitsDataModule
    from vae_ddp.model import VAE
    from vae_ddp.studies.dp import DataParallelVAE

    seen = {}

    class Keep(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen["state"] = copy.deepcopy(pl_module.state_dict())
            seen["x"] = batch[0].clone()

    out = {}
    for logged in (-1, None):
        pl.seed_everything(0, verbose=False)
        model = DataParallelVAE(replicas=2, dp_mode="emulate", replica_seed=0, logged_replica=logged,
                                enc_type="small", latent_dim=8)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[Keep()])
        trainer.fit(model, datamodule=DigitsDataModule(batch_size=32))
        out[logged] = (float(trainer.callback_metrics["train_kl"]), float(model.last_logs["kl"]))
    logged_kl, global_kl = out[-1]
    assert out[None][0] == pytest.approx(out[None][1])  # mean over replicas: the global batch
    assert logged_kl != pytest.approx(global_kl)
    # the last replica's chunk, recomputed: same weights, chunk 1, its generator's first draw
    ref = VAE(enc_type="small", latent_dim=8)
    ref.load_state_dict(seen["state"])
    ref.train()
    chunk = seen["x"].chunk(2)[-1]
    eps = torch.randn((len(chunk), 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert logged_kl == pytest.approx(float(ref.step(chunk, eps)[1]["kl"]), rel=1e-5)


# --------------------------------------------------------------------------- the verdict
def _seeds(p: float = 0.4) -> dict:
    q = {"vs_single": {"p": p}}
    return {"settings": {"steps": 150, "model": "small", "global_batch_size": 64}, "num_seeds": 10,
            "summary": {"ddp": {"train_kl": q, "val_kl": {"vs_single": {"p": 0.9}}}}}


def test_verdict_reads_the_statistics_contract_and_falls_back_to_p_values():
    from vae_ddp.studies.verdict import decide

    assert decide(_seeds(0.4))["kind"] == "inconclusive"
    assert "p = 0.40" in decide(_seeds(0.4))["lines"][0]
    assert decide(_seeds(0.01))["kind"] == "different"
    contract = {**_seeds(0.01), "verdict": {"ddp": {"train_kl": "equivalent"}}, "verdict_lines": ["ddp: equivalent"]}
    d = decide(contract)
    assert d["kind"] == "equivalent" and "not a bug" in d["title"]
    assert d["lines"][0].startswith("**ddp** vs one device (10 seeds x 150 steps"), d["lines"][0]
    assert d["lines"][0].endswith(": KL equivalent (train)"), d["lines"][0]
    # a quantity that differs is named in the title with its size, from the data
    worse = {**contract, "verdict": {"ddp": {"train_kl": "equivalent", "val_kl": "different"},
                                     "ddp+fixed": {"train_kl": "equivalent", "val_kl": "equivalent"}},
             "summary": {"ddp": {"val_kl": {"vs_single": {"p": 0.001, "diff": 0.03, "mean_b": 1.0}}}}}
    d = decide(worse)
    assert "validation KL ends 3% higher (equivalent with the fixes)" in d["title"], d["title"]
    assert d["lines"][0].endswith(": KL equivalent (train), +3% (val)"), d["lines"][0]
    d = decide(contract, {"verdict": "different", "summary": "KL drifts after 2,000 steps."})
    assert d["kind"] == "different" and d["lines"][-1] == "KL drifts after 2,000 steps."
    # with its comparison, the long-horizon check is stated in the same words as the seed study
    lh = {"verdict": "different", "summary": "-", "settings": {"steps": 2000},
          "comparison": {"train_kl": {"verdict": "inconclusive"},
                         "train_recon_loss": {"verdict": "different", "diff": -0.02, "mean_b": 1.0}}}
    assert decide(contract, lh)["lines"][-1] == ("**shared vs independent noise** after 2,000 steps: "
                                                "KL inconclusive (train); reconstruction -2% (train)")


def test_verdict_box_orders_reasons_by_the_report_scale_measurement():
    from vae_ddp.studies.verdict import UPSTREAM, verdict_box

    rs = {"settings": {"model": "resnet18", "world_size": 2, "global_batch_size": 256},
          "ranking": [{"factor": "random streams per rank", "ratio": 1.2, "kind": "gradient"},
                      {"factor": "logging", "ratio": 0.7, "kind": "logged KL"},
                      {"factor": "BatchNorm statistics", "ratio": 0.15, "kind": "gradient"}],
          "spread": {"kl_spread_ratio": 1.4}, "reduction": {"unequal_steps_per_epoch": 0}}
    box = verdict_box({"seeds": _seeds(), "long_horizon": None, "report_scale": rs})
    assert box.startswith('!!! success "Expected behaviour')
    i, j, k = box.index("1. [Random streams"), box.index("2. [Logging"), box.index("3. [BatchNorm")
    assert i < j < k and "1.20x" in box and "x1.40" in box and UPSTREAM in box
    code = box[box.index("```python"):box.index("```", box.index("```python") + 3)].splitlines()[1:]
    assert len(code) <= 6 and any("sync_dist=True" in ln for ln in code)


def test_home_verdict_is_generated_from_the_committed_results(generated):
    from vae_ddp.studies.verdict import load, verdict_box

    decision = generated("home_verdict")["decision"]
    assert decision["kind"] in ("equivalent", "inconclusive", "different")
    out = (ROOT / "docs" / "generated" / "home_verdict" / "output.md").read_text()
    assert out.rstrip() == verdict_box(load(ROOT)).rstrip()
