"""`vae-ddp audit` on small LightningModules that are not this project's VAE (examples/audit_models.py).

Each audit trains the module on one device and with 2-rank DDP (gloo) for a few steps in
float64 and must give the expected diagnosis: which factor is exposed, which bites, and
whether DDP with the fixes, started at every step from one device's weights, computes a
gradient within 2x the one-device floor.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from vae_ddp import guard
from vae_ddp.audit.study import FLOOR_DRAWS, FLOOR_RATIO
from helpers import ROOT

M = "examples.audit_models"


def audit(tmp_path: Path, model: str, *args: str, data: str = f"{M}.Regression",
          in_process: bool = True) -> tuple[int, dict, str]:
    """`vae-ddp audit ... --steps 3`: exit code, audit.json and what it printed. In this process
    (its runs are launched processes either way; one interpreter less per audit) unless
    ``in_process=False``: a command of its own, whose stderr also holds Lightning's logging and
    Python's warnings (pytest collects those in this process)."""
    out = tmp_path / "audit"
    argv = ["audit", "--model", model, "--data", data, "--steps", "3", "--out", str(out), *args]
    if in_process:
        from vae_ddp.cli import main_captured

        code, stdout, stderr = main_captured(argv, cwd=ROOT)
        log = stdout + stderr
    else:
        proc = guard.run([sys.executable, "-m", "vae_ddp.cli", *argv], capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
        code, log = proc.returncode, proc.stdout + proc.stderr
    result = json.loads((out / "audit.json").read_text()) if (out / "audit.json").exists() else {}
    return code, result, log


def by_factor(result: dict) -> dict:
    return {f["factor"]: f for f in result["findings"]}


def test_no_exposure(tmp_path):
    code, result, log = audit(tmp_path, f"{M}.Plain")
    assert code == 0, log[-3000:]
    assert set(result) >= {"devices", "steps", "dtype", "floor", "floor_draws", "grad_steps", "ratio_to_floor",
                           "deterministic", "within_floor", "divergence_default", "divergence_fixed", "findings",
                           "unexplained"}
    assert result["devices"] == 2 and result["steps"] == 3 and result["dtype"] == "float64"
    assert result["method"] == "teacher-forced" and len(result["grad_steps"]) == 3
    assert len(result["floor_draws"]) == FLOOR_DRAWS and all(len(d) == 3 for d in result["floor_draws"])
    assert result["deterministic"] and 0 < result["floor"] < 1e-14  # rounding, float64
    assert result["ratio_to_floor"] == max(result["grad_steps"]) / max(result["floor"], 2.0 ** -52)
    # another batch at the same weights: the batch-to-batch noise, far above rounding (a run
    # whose batches did not lag its weights would measure the floor), one value per step but the first
    assert len(result["batch_noise_steps"]) == 2 and result["batch_noise"] > 1e6 * result["floor"]
    runs = json.loads((tmp_path / "audit" / "runs" / "one-device" / "run.json").read_text())
    assert runs["other-batch"]["weights_of_batch"] == [0, 0, 1] and runs["floor-1"]["weights_of_batch"] == [0, 1, 2]
    assert not result["unexplained"] and not any(f["bites"] for f in result["findings"])
    assert "- passed: " in log and "none of the exposed factors changes the gradient here" in log
    # the whole step compared, not the gradient alone: rate, update, buffers, ranks, and the 3 free steps
    step = result["whole_step"]
    assert step["differences"] == [] and 0 < step["update_ratio"] <= FLOOR_RATIO and step["ranks_ratio"] == 0
    assert len(step["update_steps"]) == 3 and all(d == 0 for d in step["lr_steps"]) and step["buffer_count"] == 0
    assert result["gradient_within"] and result["trajectory_within"] and result["trajectory_ratio"] < 10
    assert "the learning rate, the update, the buffers and every rank's parameters" in log
    left = sorted(p.name for p in (tmp_path / "audit").rglob("*") if p.suffix in {".pt", ".partial"})
    assert not left and (tmp_path / "audit" / "runs" / "ddp" / "run.json").exists(), left  # tensors gone, logs kept
    # the runs it trained, as its runs' logs name them: a factor's runs only where the ddp run saw it exposed
    # (here the sampler alone: Lightning's DistributedSampler shuffles), no check of draws no fix serves
    entries = {**runs, **json.loads((tmp_path / "audit" / "runs" / "ddp" / "run.json").read_text())}
    trained = [label for label, entry in entries.items() if "same_as" not in entry]
    assert result["runs"] == trained, (result["runs"], trained)
    assert result["same_runs"] == {label: e["same_as"] for label, e in entries.items() if "same_as" in e}
    exposed = {f["factor"] for f in result["findings"] if f["exposed"]}
    assert exposed == {"sampler"}, exposed
    assert_factor_runs_follow_exposure(result)
    assert not {"single+keyed", "ddp+fixed-forced+keyed"} & set(result["runs"]), result["runs"]
    # no BatchNorm layer, no draw: those two fixes change nothing here, so the sampler's runs are the runs
    # with no fix and with every fix, trained once
    assert result["same_runs"] == {"ddp-sampler": "ddp-forced", "ddp+sampler": "ddp+fixed-forced",
                                   "effect-sampler": "effect-defaults"}, result["same_runs"]
    # and nothing is left for the user's code: DDP with every fix measures no effect of its own
    assert "effect-fixed" not in result["runs"] and not any(f["exposed"] and not f["automatic_fix"]
                                                            for f in result["findings"])
    assert len(result["runs"]) == 13 and "[audit] 13 of 25 planned runs trained" in log, result["runs"]
    sampler = by_factor(result)["sampler"]
    assert sampler["contribution"] == result["none_fixed"] and sampler["fixed_alone"] == max(result["grad_steps"])
    assert sampler["effect"]["kind"] == result["effect"]["kind"] == "exact"


def assert_factor_runs_follow_exposure(result: dict) -> None:
    """Each factor the audit fixes has its runs (``ddp-<key>``, ``ddp+<key>``, ``effect-<key>``) in
    ``audit.json``'s ``runs`` (or ``same_runs``: the same as a run trained) exactly when it, or a factor its
    fix removes too, is exposed."""
    from vae_ddp.audit.effects import measured_by
    from vae_ddp.fixes import registry

    exposed = {f["factor"] for f in result["findings"] if f["exposed"] and f["automatic_fix"]}
    measured = set(result["runs"]) | set(result["same_runs"])  # trained, or the same as a run trained
    assert set(result["same_runs"].values()) <= set(result["runs"]), result["same_runs"]
    for key in registry.audit_fixable():
        ablation = {f"ddp-{key}", f"ddp+{key}"}
        assert (ablation <= measured) == (key in exposed), (key, exposed, result["runs"])
        assert not ablation & measured or key in exposed, (key, result["runs"])
        assert (f"effect-{key}" in measured) == bool(exposed & set(measured_by(key))), (key, result["runs"])
    # what every audit trains
    assert {"single", "ddp", "ddp+fixed", "ddp+fixed-forced", "ddp-forced", "effect-single",
            "effect-defaults"} <= set(result["runs"]), result["runs"]
    # DDP with every fix measures the effect of what only the user's code fixes, where there is such a factor
    left = any(f["exposed"] and not f["automatic_fix"] for f in result["findings"])
    assert not left or "effect-fixed" in measured, result["runs"]


def test_gradient_clipping_and_accumulation_pass_through(tmp_path):
    """The user's Trainer arguments reach every run, as LightningCLI spells them. Clipping by
    the global norm is no false alarm: one step's gradient from the same weights is judged,
    not the parameters after K steps (a K-step comparison once called clipping 'unexplained')."""
    code, result, log = audit(tmp_path, f"{M}.Plain", "--trainer.gradient_clip_val", "0.05",
                              "--trainer.accumulate_grad_batches=2", in_process=False)
    assert code == 0 and result["within_floor"], log[-3000:]
    assert result["trainer"] == {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2}
    # another batch: one optimizer step (two batches) later, at the same weights
    assert len(result["batch_noise_steps"]) == 2 and result["batch_noise"] > 1e6 * result["floor"]
    runs = json.loads((tmp_path / "audit" / "runs" / "one-device" / "run.json").read_text())
    assert runs["other-batch"]["weights_of_batch"] == [0, 1, 0, 1, 2, 3]
    assert "gradient_clip_val=0.05" in log and "accumulate_grad_batches=2" in log  # the table's title
    assert "Tip:" not in log and "GPU available" not in log  # Lightning's chatter from checking the values


def test_a_run_that_needs_unused_parameters_says_how(capsys, monkeypatch, tmp_path):
    from vae_ddp.audit import study
    from vae_ddp.cli import main
    from vae_ddp.harness.launch import RunFailed

    def failing(*args, **kwargs):
        raise RunFailed("run 'ddp' exited with code 1; first error: RuntimeError: ... `strategy='ddp_find_unused_"
                        "parameters_true'` or by setting the flag in the strategy with `strategy=DDPStrategy("
                        "find_unused_parameters=True)`.")

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(study, "audit", failing)
    code = main(["audit", "--model", f"{M}.Gan", "--data", f"{M}.Regression", "--out", str(tmp_path / "a")])
    assert code == 3
    assert "needs --trainer.strategy ddp_find_unused_parameters_true" in capsys.readouterr().err


def test_a_parameter_unused_on_a_rank_is_named_before_ddp_hangs(tmp_path):
    """A mixture of experts that skips an expert with no samples (examples.audit_models.SkippedExpert):
    some rank's share of a global batch routes nothing to expert 1, whose parameters then get no
    gradient there, and plain Lightning DDP without find_unused_parameters hangs on it
    (tests/scripts/skipped_expert_truth.py, no vae_ddp: 3 steps with ddp_find_unused_parameters_true,
    no step in 10 minutes without). The audit names the parameters and Lightning's flag before any DDP run (exit 2),
    and with the flag it trains and judges the model."""
    code, result, log = audit(tmp_path, f"{M}.SkippedExpert")
    assert code == 2 and not result, log[-3000:]
    assert "(experts.1.weight, experts.1.bias)" in log and "--trainer.strategy ddp_find_unused_parameters_true" in log
    assert "experts.0" not in log  # used on every rank's share
    code, result, log = audit(tmp_path, f"{M}.SkippedExpert", "--trainer.strategy", "ddp_find_unused_parameters_true")
    assert code == 0 and result["within_floor"], log[-3000:]


def test_random_draws_in_the_step_are_not_judged(tmp_path):
    """NumPy's generator in training_step (nothing torch draws, which the audit could key to the
    samples): permuting the samples changes one device's step by far more than rounding, so the audit
    says so and does not pass the model (exit 1)."""
    code, result, log = audit(tmp_path, f"{M}.NumpyNoise")
    assert code == 1 and not result["deterministic"] and not result["within_floor"], log[-3000:]
    assert result["floor"] > 1e-6 and not result["unexplained"]
    assert "not judged: permuting the samples" in log
    # a plain mean loss: the reduction check says it cannot tell, and flags nothing
    assert not by_factor(result)["reduction"]["exposed"], by_factor(result)["reduction"]
    assert any("check of the loss reduction was skipped" in n for n in result["notes"]), result["notes"]


def test_batchnorm(generated):
    """The audit the site shows (registry entry ``audit_batchnorm``), read, not rerun."""
    result = generated("audit_batchnorm", "audit.json")
    f = by_factor(result)
    assert f["batchnorm"]["exposed"] and f["batchnorm"]["bites"], result
    assert result["findings"][0]["factor"] == "batchnorm"  # ranked first: the largest contribution
    # the classes as the page's command names them, not the module the audit made of the file
    assert result["model"]["class_path"] == result["model_name"] == "examples/audit_models.py:WithBatchNorm"
    assert result["data"]["class_path"] == "examples/audit_models.py:Regression"
    b = f["batchnorm"]  # the same effect over the difference another batch makes at the same weights
    assert b["vs_batch_noise"] == pytest.approx(b["contribution"] / result["batch_noise"]) and result["batch_noise"] > 0
    # from the other end: BatchNorm's fix alone leaves the floor of the difference with no fix; the
    # sampler's alone (contiguous chunks, still per-rank statistics) leaves all of it (the page says so)
    yardstick = max(result["floor"], torch.finfo(torch.float64).eps)
    assert result["none_fixed"] > 1e6 * yardstick and b["fixed_alone"] <= FLOOR_RATIO * yardstick, result
    assert f["sampler"]["fixed_alone"] > 0.5 * result["none_fixed"], f["sampler"]
    assert result["divergence_default"] > 1e3 * result["trajectory_floor"]
    assert result["within_floor"] and not result["unexplained"]  # every difference explained and fixed ...
    # ... but DDP as it is run trains another model: per-rank statistics, named (exit 1, the fix the advice)
    assert result["exit_code"] == 1 and result["exit_why"] == ["batchnorm"], result["exit_why"]
    # BatchNorm's runs trained, as it is exposed (and the sampler's); not the noise's (no draws). Its fix idle,
    # each exposed factor's ablation (every fix but its own) is the other's fix alone: trained once
    assert {"ddp-batchnorm", "ddp-sampler", "effect-batchnorm"} <= set(result["runs"]), result["runs"]
    assert result["same_runs"] == {"ddp+batchnorm": "ddp-sampler", "ddp+sampler": "ddp-batchnorm"}
    assert not f["noise"]["exposed"] and "ddp-noise" not in result["runs"], result["runs"]
    assert_factor_runs_follow_exposure(result)


def test_dropout(generated):
    """The audit the site shows (registry entry ``audit_dropout``), read, not rerun."""
    result = generated("audit_dropout", "audit.json")
    f = by_factor(result)
    assert f["noise"]["exposed"] and f["optimizer"]["exposed"], result
    assert f["noise"]["bites"] and not result["unexplained"], result
    # the same masks on every rank: another model as DDP is run, whatever the fixes close
    assert result["exit_code"] == 1 and "noise" in result["exit_why"] and f["noise"]["mechanism"] == "another model"


def test_masked_token_mean(tmp_path):
    code, result, log = audit(tmp_path, f"{M}.MaskedTokens")
    f = by_factor(result)
    assert f["reduction"]["exposed"] and "differs per rank" in f["reduction"]["evidence"], log[-3000:]
    assert "global_token_cross_entropy" in f["reduction"]["fix"]
    assert code == 1 and not result["unexplained"]  # explained, but only the user can fix it
    # asked again under the process group (eval mode, every fix): confirmed, and said so
    assert result["reduction_under_ddp"]["ratio_to_floor"] > FLOOR_RATIO
    assert "under DDP's process group too" in f["reduction"]["evidence"]


def test_a_global_token_mean_is_not_flagged(tmp_path):
    """The one-process reduction check (no process group) sees a per-chunk token mean; under
    DDP the global count makes the gradient one device's, so the flag is cleared and said."""
    code, result, log = audit(tmp_path, f"{M}.GlobalTokens")
    assert code == 0 and result["within_floor"], log[-3000:]
    assert not by_factor(result)["reduction"]["exposed"]
    assert any("already reduced over the global batch" in n for n in result["notes"]), result["notes"]


def test_per_rank_padding_is_named_not_the_reduction(tmp_path):
    """A global token mean (one-process check: flagged, no process group) with dropout, over
    batches padded per rank in the collate_fn: the reduction is asked again under the process
    group in eval mode and cleared; what is left is named, the ranks' batch shapes, with the
    fix in the user's code (exit 1, not "unexplained")."""
    code, result, log = audit(tmp_path, f"{M}.PaddedTokensDropout", data=f"{M}.PaddedTokens")
    f = by_factor(result)
    assert code == 1 and result["deterministic"] and not result["within_floor"], log[-3000:]
    assert result["reduction_under_ddp"]["ratio_to_floor"] <= FLOOR_RATIO, result["reduction_under_ddp"]
    assert not f["reduction"]["exposed"], f["reduction"]
    assert any("in eval mode" in n and "already reduced over the global batch" in n for n in result["notes"])
    assert not result["unexplained"]
    assert f["sampler"]["exposed"] and not f["sampler"]["automatic_fix"], f["sampler"]
    assert "differ in shape" in f["sampler"]["evidence"] and "max_length=L" in f["sampler"]["fix"]
    assert "needs your code" in log and '(see the "Sampler and data order" page' in log  # no published site here
    # measured too: what is left with every automatic fix on, ranked by it among what bites
    assert (f["sampler"]["left_after_fixes"] == max(result["grad_steps"])
            and result["findings"][0]["factor"] == "sampler")
    # every finding carries its effect: what only the user's code fixes, by DDP with every automatic fix on;
    # the optimizer (Adam under the shared dropout masks) by the noise's run, whose fix removes it
    exposed = {k: g for k, g in f.items() if g["exposed"]}
    assert {"sampler", "noise", "optimizer"} <= set(exposed), sorted(exposed)
    assert all(g["effect"] is not None for k, g in exposed.items() if k != "logging"), exposed
    assert f["optimizer"]["effect"] == f["noise"]["effect"] and "Adam" in f["optimizer"]["evidence"]
    # without dropout the shapes make no difference: seen, said in a note, and the audit passes
    code, result, log = audit(tmp_path / "p0", f"{M}.PaddedTokensDropout", "--model.init_args.p", "0",
                              data=f"{M}.PaddedTokens")
    assert code == 0 and result["within_floor"], log[-3000:]
    assert not any(f["exposed"] and not f["automatic_fix"] for f in result["findings"]), result["findings"]
    assert any("differ in shape" in n and "makes no difference here" in n for n in result["notes"]), result["notes"]


def test_the_table_fits_100_columns(generated):
    """The widest cells the audit writes (the longest factor name, a value and its ratio to the
    floor both with exponents, each verdict) keep every row of the table within 100 columns;
    the rest (evidence, fixes) is a list below it."""
    from vae_ddp.audit.render import render
    from vae_ddp.audit.verdict import Verdict

    result = json.loads(json.dumps(generated("audit_batchnorm", "audit.json")))
    result["floor"] = 1.23456e-300
    cells = [dict(contribution=1.23456e-5, bites=False), dict(contribution=1.23456e-5, bites=None),
             dict(contribution=1.23456e-5, bites=True), dict(contribution=None, left_after_fixes=1.23456e-5,
                                                             automatic_fix=False)]
    widest = dict(kind="same distribution", bias=1.23456e-5, bias_ci=[1.23456e-5] * 2, variance_ratio=1.23456e-5,
                  variance_ratio_ci=[1.23456e-5] * 2, quantity="buffers")  # the effects' table, a row per finding
    for f, cell in zip(result["findings"], cells * 2):
        f.update(exposed=True, vs_batch_noise=1.23456e-5, **cell)
    for f in result["findings"]:
        f["effect"] = widest
    result["effect"] = widest
    rows = [line for line in render(Verdict.from_dict(result)).splitlines() if line.startswith("|")]
    assert len(rows) == 2 * len(result["findings"]) + 5 and "your code: 1.23e-05 left (5.6e+10x floor)" in "".join(rows)
    assert "| only which samples or draws (buffers) |" in "".join(rows)
    assert max(len(r) for r in rows) <= 100, "\n".join(r for r in rows if len(r) > 100)


def test_audit_json_is_the_verdict_and_renders_its_report(generated):
    """audit.json is a Verdict as it is: read back, the same keys in the same order and the same values,
    and it renders the tables.md written beside it (which benchmarks/fault_injection.py relies on)."""
    from vae_ddp.audit.render import render
    from vae_ddp.audit.verdict import Verdict

    result = generated("audit_batchnorm", "audit.json")
    verdict = Verdict.from_dict(result)
    assert json.dumps(verdict.to_dict(), indent=1) == json.dumps(result, indent=1)
    assert render(verdict) + "\n" == (ROOT / "docs" / "generated" / "audit_batchnorm" / "tables.md").read_text()
    with pytest.raises(TypeError):  # a key that is no field of the verdict
        Verdict.from_dict(dict(result, unknown=1))


def test_the_table_ranks_by_measured_effect():
    """The order of the audit's rows, from made-up findings: what bites and what needs the
    user's code by their measured effect; a factor that needs a code change never below one
    that does not bite or cannot be separated; the unexposed last."""
    from vae_ddp.audit.judge import _rank

    def f(name, exposed=True, automatic=True, contribution=None, bites=None, left=None):
        return dict(factor=name, exposed=exposed, automatic_fix=automatic, contribution=contribution, bites=bites,
                    left_after_fixes=left)

    rows = [f("quiet", contribution=1e-16, bites=False), f("unseen", exposed=False),
            f("mixed", contribution=0.5, bites=None), f("small", contribution=1e-3, bites=True),
            f("yours", automatic=False, left=1e-2), f("yours, not measured", automatic=False),
            f("large", contribution=0.2, bites=True)]
    assert [r["factor"] for r in sorted(rows, key=_rank)] == [
        "large", "yours", "small", "yours, not measured", "mixed", "quiet", "unseen"]


def test_all_gather_with_gradients(tmp_path):
    """A module that calls self.all_gather cannot run training_step without a Trainer: the
    one-process check runs it with a one-device Trainer attached, where all_gather returns the
    rank's own batch, so in-batch negatives over the gathered batch look coupled there. It leaves the
    loss to the DDP runs with a note (it flagged it, and a DDP difference of another cause kept the flag:
    the gallery's SimCLR with per-rank views, and with a gloo all_gather bug, were blamed on the loss);
    the DDP runs find the loss already gathers over the global batch (nothing on stderr)."""
    code, result, log = audit(tmp_path, f"{M}.GatheredNegatives", in_process=False)
    assert code == 0 and result["within_floor"], log[-3000:]
    assert any("gathers across ranks (all_gather)" in n for n in result["notes"]), result["notes"]
    assert not by_factor(result)["reduction"]["exposed"]
    assert "not attached" not in log and "self.log()" not in log


def test_unsynced_logging(tmp_path):
    code, result, log = audit(tmp_path, f"{M}.Unsynced")
    f = by_factor(result)
    assert code == 0, log[-3000:]
    assert f["logging"]["exposed"] and "train_loss" in f["logging"]["evidence"]
    assert f["logging"]["contribution"] is None  # logging changes the logged curve, not the parameters


def test_padding(tmp_path):
    code, result, log = audit(tmp_path, f"{M}.Plain", "--data.init_args.n", "37", "--steps", "6")
    f = by_factor(result)
    assert code == 0, log[-3000:]
    assert f["reduction"]["exposed"] and "1 repeated of 37" in f["reduction"]["evidence"]


def test_two_optimizers(tmp_path):
    code, result, log = audit(tmp_path, f"{M}.TwoOptimizers")
    assert code == 0, log[-3000:]
    assert result["within_floor"] and result["ratio_to_floor"] <= FLOOR_RATIO
    assert len(result["grad_steps"]) == 2 * 2  # 3 steps = 2 batches of two optimizer steps each (Lightning counts both)
    assert len(result["batch_noise_steps"]) == 2 and result["batch_noise"] > 1e6 * result["floor"]  # one batch later


def test_augmentation_with_workers(tmp_path):
    code, result, log = audit(tmp_path, f"{M}.Plain", "--data.init_args.augment", "true",
                              "--data.init_args.num_workers", "1", "--effect_batches", "0")
    f = by_factor(result)
    # the effects skipped: none measured, no table of them (the verdict as with them)
    assert result["effect"] is None and result["effect_rows"] is None and "What each exposed factor" not in log
    assert all(g["effect"] is None for g in result["findings"])
    assert f["noise"]["exposed"] and "augmentation" in f["noise"]["evidence"], log[-3000:]
    assert code == 1 and not result["unexplained"] and "noise" in result["exit_why"]
    # the ranks' draws measured (#48 item 5), as plain Lightning measures them (tests/scripts/loader_draws_truth.py)
    t = json.loads((ROOT / "tests/scripts/loader_draws_truth.json").read_text())["augment"]
    d = result["unkeyed_draws"]["dataset"]
    assert d["repeated"] and f"{t['distinct'][0]} distinct draws of {t['ranks'] * t['per_rank']}" in d["state"], d
    assert "the same augmentation as rank 0's" in f["noise"]["evidence"] and f["noise"]["mechanism"] == "another model"
    assert "seed_everything(seed, workers=True)" in f["noise"]["fix"]
    # the rest of the step, each sample's draws keyed to its index: one device's
    assert result["gradient_within"] and result["trajectory_within"], log[-3000:]
    # the user's loader forks its worker from a rank that runs threads: the audit says so and
    # starts it from a forkserver instead (a forked worker hung 1 audit in 7)
    assert any("forkserver" in n and "threads" in n for n in result["notes"]), result["notes"]
    assert "- note: the DataLoader forks its 1 worker(s)" in log


@pytest.mark.parametrize("args, message", [
    (["--model", "no.such.Module"], "--model"),
    (["--model", f"{M}.NoTrainingStep"], "has no training_step"),
    (["--model", f"{M}.Plain", "--data", f"{M}.Empty"], "yields no batch"),
    (["--model", f"{M}.Plain", "--data.init_args.batch_size", "15"], "not divisible by 2"),
    (["--model", f"{M}.OnlyCuda"], "fails on CPU"),
    (["--model", "examples/missing.py:Net"], "does not exist"),
    (["--model", f"{M}.Plain", "--data.init_args.n", "8"], "fewer than one global batch"),
    (["--model", f"{M}.Plain", "--trainer.strategy", "fsdp"], "is not a DDP strategy"),
    (["--model", f"{M}.Plain", "--trainer.strategy=deepspeed"], "is not a DDP strategy"),
    (["--model", f"{M}.Plain", "--trainer.accumulate_grad_batches", "0"], "--trainer.accumulate_grad_batches"),
    (["--model", f"{M}.Plain", "--effect_batches", "2"], "--effect_batches must be 0 (skip) or at least 4, got 2"),
    (["--model", f"{M}.Plain", "--effect_batches=-1"], "--effect_batches must be 0 (skip) or at least 4, got -1"),
    (["--model", f"{M}.Plain", "--trainer.gradient_clip_algorithm=sideways"], "--trainer.gradient_clip_algorithm"),
    # jsonargparse's errors, one line each with the flag as it was given (dotted names kept)
    (["--model", f"{M}.Plain", "--steps", "ten"], "--steps: expected int, got 'ten'"),
    (["--model", f"{M}.Plain", "--dtype", "float16"], "unknown --dtype 'float16': use one of float64, float32"),
    (["--model", f"{M}.Plain", "--trainer.gradient_clip_val", "abc"],
     "--trainer.gradient_clip_val: expected "),  # Trainer's own type (int, float, null: jsonargparse's order varies)
    (["--model", f"{M}.Plain", "--model.init_args.hidden", "4"],
     "--model.init_args.hidden: Plain has no init argument 'hidden'"),
    (["--model", f"{M}.Plain", "--data.init_args.batch_size", "x"],
     "--data.init_args.batch_size: expected int, got 'x'"),
    (["--model", "examples/audit_models.py:Plain", "--model.init_args.hidden=4"],
     "--model.init_args.hidden: Plain has no init argument 'hidden'"),
    (["--model", f"{M}.Plain", "--trainer.precision", "16"],
     "--trainer.precision '16' is not one the audit compares: give one of 64-true, 32-true, bf16-mixed, 16-mixed"),
    (["--model", f"{M}.Plain", "--trainer.max_steps", "5"], "--trainer.max_steps: the audit sets it (--steps); the "
                                                           "audit accepts --trainer.strategy, --trainer.precision"),
    (["--model", f"{M}.Plain", "--trainer.num_nodes", "2"], "--trainer.num_nodes: the audit sets it (--devices, on"),
    (["--model", f"{M}.Plain", "--trainer.callbacks", "[]"], "--trainer.callbacks: the audit sets it"),
    (["--model", f"{M}.Plain", "--trainer.max_stepz", "5"], "--trainer.max_stepz: Trainer takes no such argument"),
    (["--model", f"{M}.Plain", "--trainer.limit_train_batches", "x"], "--trainer.limit_train_batches: expected"),
    # a class the file does not define, named as given in both spellings (not the module made of the file)
    (["--model", "examples/audit_models.py:Nope"],
     "--model examples/audit_models.py:Nope does not import (examples/audit_models.py defines no Nope)"),
    (["--model=examples/audit_models.py:Nope"],
     "--model examples/audit_models.py:Nope does not import (examples/audit_models.py defines no Nope)"),
    (["--model=no.such.Module"], "--model no.such.Module does not import"),
    (["--data", f"{M}.Regression"], "the following arguments are required: --model"),
    # a flag typed with dashes (another command line's spelling) is answered with this one's
    (["--model", f"{M}.Plain", "--data.init-args.batch-size", "15"],
     "--data.init-args.batch-size: flags are the Python names, with underscores: --data.init_args.batch_size"),
    (["--model", f"{M}.Plain", "--data.batch-size", "15"], "with underscores: --data.batch_size"),
    (["--model", f"{M}.Plain", "--trainer.max-steps", "5"], "with underscores: --trainer.max_steps"),
    (["--model", f"{M}.Plain", "--global-batch-size", "8"], "with underscores: --global_batch_size; see -h"),
])
def test_bad_input(tmp_path, args, message, capsys, monkeypatch):
    """In this process (each is found before anything is launched): exit code 2, one line."""
    from vae_ddp.cli import main

    argv = list(args)
    if "--data" not in argv:
        argv[2:2] = ["--data", f"{M}.Regression"]  # the class before its init args
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the audit puts the working directory on it
    code = main(["audit", *argv, "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.strip() and "self.log" not in ln and "warn" not in ln.lower()]
    assert len(lines) == 1 and message in lines[0], err
    if message.endswith("expected "):
        assert "got 'abc'" in lines[0] and all(t in lines[0] for t in ("int", "float", "null")), lines
    assert "Traceback" not in err
    assert not (tmp_path / "a" / "runs").exists()  # nothing trained


@pytest.mark.parametrize("spelling", [["--model.help", "examples/audit_models.py:WithDropout"],
                                      ["--model.help=examples/audit_models.py:WithDropout"]], ids=["space", "equals"])
def test_the_init_arguments_of_a_class_in_a_file(spelling, capsys, monkeypatch):
    """``--model.help path/to/file.py:Class`` lists its init arguments under this command's name
    and the class as given."""
    from vae_ddp.cli import main

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    code = main(["audit", *spelling])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("usage: vae-ddp audit ") and "--model.p P" in out, out
    assert "examples/audit_models.py:WithDropout" in out and "_vae_ddp_user" not in out, out


def test_print_config_of_a_class_in_a_file_reads_back(tmp_path, capsys, monkeypatch):
    """``--print_config`` names a class made of a file by its file (absolute: a config's relative
    paths are read from its own folder), and ``--config`` reads that file back; a file a config
    names that does not exist is one line."""
    from vae_ddp.cli import main

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    code = main(["audit", "--model", "examples/audit_models.py:Plain", "--data", f"{M}.Regression", "--print_config"])
    printed = capsys.readouterr().out
    assert code == 0 and f"class_path: {ROOT / 'examples' / 'audit_models.py'}:Plain" in printed, printed
    assert "_vae_ddp_user" not in printed
    (tmp_path / "c.yaml").write_text(printed)
    code = main(["audit", "--config", str(tmp_path / "c.yaml"), "--steps", "0", "--out", str(tmp_path / "a")])
    assert code == 2 and capsys.readouterr().err.strip() == "vae-ddp audit: error: --steps must be at least 1, got 0"
    (tmp_path / "c.yaml").write_text("model:\n  class_path: nowhere.py:Net\n")
    code = main(["audit", "--config", str(tmp_path / "c.yaml"), "--data", f"{M}.Regression",
                 "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "nowhere.py does not exist" in err, err


def test_a_failed_run_is_exit_code_3_not_a_verdict(tmp_path, capsys, monkeypatch):
    """A run that fails (or hangs) says so in one line with exit code 3; 1 means the audit's verdict."""
    from vae_ddp.audit import study
    from vae_ddp.cli import main
    from vae_ddp.harness.launch import RunFailed

    def failing(*args, **kwargs):
        raise RunFailed("run 'ddp' exited with code 1; first error: RuntimeError: boom")

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(study, "audit", failing)
    code = main(["audit", "--model", f"{M}.Plain", "--data", f"{M}.Regression", "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert code == 3 and "boom" in err, err


def test_a_failed_audit_keeps_the_earlier_report_and_says_whose_it_is(tmp_path, capsys, monkeypatch):
    """An audit that fails (a run raising, killed, a rank gone) into a folder with an earlier report
    leaves that report whole (it deleted audit.json and tables.md when it planned its runs) and says
    that the report there is the earlier one."""
    from vae_ddp.audit import study
    from vae_ddp.cli import main
    from vae_ddp.harness.launch import RunFailed

    out = tmp_path / "a"
    (out / "runs").mkdir(parents=True)
    (out / "audit.json").write_text('{"within_floor": true}')
    (out / "tables.md").write_text("the earlier report\n")

    def failing(plan, runs_dir):
        raise RunFailed("run 'ddp' exited with code 1; first error: RuntimeError: boom")

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(study, "_measure", failing)
    code = main(["audit", "--model", f"{M}.Plain", "--data", f"{M}.Regression", "--steps", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 3 and "boom" in err, err
    assert (out / "audit.json").read_text() == '{"within_floor": true}'
    assert (out / "tables.md").read_text() == "the earlier report\n"
    assert f"{out / 'tables.md'} and audit.json are not this audit's: they are the earlier report" in err, err


def test_the_runs_folder_is_not_written_through_a_planted_link(tmp_path, capsys, monkeypatch):
    """``--out``'s runs folder planted as a link to a folder of the user's (a --out others can write):
    the audit deleted and wrote files through it; refused now in one line (exit 2), the target untouched."""
    from vae_ddp.audit import study
    from vae_ddp.cli import main

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "single-steps.pt").write_text("precious")
    out = tmp_path / "a"
    out.mkdir()
    (out / "runs").symlink_to(victim)
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(study, "_measure", lambda plan, runs_dir: (_ for _ in ()).throw(AssertionError("ran")))
    code = main(["audit", "--model", f"{M}.Plain", "--data", f"{M}.Regression", "--steps", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"{out / 'runs'} is a link to {victim}" in err, err
    assert [p.name for p in victim.iterdir()] == ["single-steps.pt"]
    assert (victim / "single-steps.pt").read_text() == "precious"


def test_out_is_where_the_command_started_whatever_the_module_does(tmp_path, capsys, monkeypatch):
    """A module whose __init__ calls os.chdir('/') made a relative --out resolve under /: exit 0 and
    the report in /out/..., without a word. --out is resolved when the command starts, the runs
    start in that folder, and the output says where the report was written."""
    from types import SimpleNamespace

    from vae_ddp.audit import study
    from vae_ddp.cli import main

    seen = {}

    def measured(plan, runs_dir):
        seen.update(cwd=os.getcwd(), runs_dir=runs_dir)
        return SimpleNamespace(runs=[], same_runs={})  # what _audit reads of a Measured

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(ROOT), *sys.path])
    monkeypatch.setattr(study, "_measure", measured)
    verdict = SimpleNamespace(to_dict=lambda: {"within_floor": True, "exit_code": 0})  # what _audit reads of one
    monkeypatch.setattr(study, "_judge", lambda plan, runs, notes: verdict)
    monkeypatch.setattr(study, "render", lambda verdict: "the table")
    stray = Path("/", f"t51-out-{os.getpid()}")
    try:
        code = main(["audit", "--model", str(ROOT / "tests/scripts/changes_folder.py:ChangesFolder"), "--data",
                     f"{M}.Regression", "--steps", "1", "--out", stray.name])
        out = capsys.readouterr().err  # what the audit says it does: stderr (stdout is the report)
        assert code == 0 and not stray.exists(), out
    finally:
        import shutil

        shutil.rmtree(stray, ignore_errors=True)
    assert (tmp_path / stray.name / "tables.md").read_text() == "the table\n"
    assert seen == {"cwd": str(tmp_path), "runs_dir": tmp_path / stray.name / "runs"}, seen
    assert (f"[audit] report of this audit written to {tmp_path / stray.name / 'tables.md'} and "
            f"{tmp_path / stray.name / 'audit.json'}") in out, out


def test_a_world_size_says_what_it_costs_and_one_that_does_not_fit_is_refused(tmp_path, capsys, monkeypatch):
    """--devices 64 on 2 cores started 69 processes without a word: the output says what a world
    size costs (processes, cores, memory) before anything starts, and refuses one whose processes
    would not fit in memory (exit 2, one line, nothing built or started)."""
    import vae_ddp.harness.resources as resources
    from vae_ddp.audit import study
    from vae_ddp.cli import main
    from vae_ddp.harness.launch import RunFailed

    def failing(plan, runs_dir):
        raise RunFailed("run 'ddp' exited with code 1; first error: RuntimeError: stopped here")

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(study, "_measure", failing)
    monkeypatch.setattr(resources, "_available_memory", lambda: 10 ** 9)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    args = ["audit", "--model", f"{M}.Plain", "--data", f"{M}.Regression", "--steps", "1", "--data.batch_size"]
    code = main([*args, "64", "--devices", "64", "--out", str(tmp_path / "big")])
    captured = capsys.readouterr()
    assert code == 2 and captured.err.count("\n") == 1 and not (tmp_path / "big").exists(), captured
    assert ("--devices 64: 65 processes (64 DDP ranks and the one-device runs beside them) need about 9.8 GB of "
            "memory (150.0 MB each), 1.0 GB is available: use at most --devices 5") in captured.err, captured.err
    code = main([*args, "16", "--devices", "4", "--out", str(tmp_path / "small")])
    out = capsys.readouterr().err  # before anything starts, on stderr: stdout is the report's
    assert code == 3, out
    assert ("[audit] cost: 5 processes (4 DDP ranks and the one-device runs beside them) on 2 CPU cores, about 2x as "
            "long per step as with a core each; about 750.") in out.splitlines()[0], out


def test_a_failing_one_device_run_is_exit_code_3_with_its_own_error(tmp_path):
    """The one-device runs train beside the DDP ranks in the same launch: when they fail, the
    DDP runs waiting for their weights stop, and the audit names the one-device error, not theirs."""
    code, result, output = audit(tmp_path, "tests/scripts/fails_alone.py:FailsAlone")
    assert code == 3 and not result, output[-2000:]
    assert not list((tmp_path / "audit").rglob("*.pt"))  # a failed audit leaves no tensors either
    first = next(ln for ln in output.splitlines() if ln.startswith("vae-ddp audit: error:"))
    assert "first error: RuntimeError: one device exploded on purpose" in first, first
    assert first.startswith("vae-ddp audit: error: run 'single' "), first  # not all 22 runs' names


def test_a_one_device_process_that_dies_ends_the_audit(tmp_path):
    """Ended without a Python exception (os._exit, a signal): the DDP runs waiting for its weights
    see the process gone and stop at once, instead of waiting out their 30 minutes."""
    code, result, output = audit(tmp_path, "tests/scripts/fails_alone.py:ExitsAlone")
    assert code == 3 and not result, output[-2000:]
    assert "ended without writing" in output, output[-2000:]


@pytest.mark.parametrize("spelling", [["--model", "nowhere.py:Net"], ["--model=nowhere.py:Net"]])
def test_a_missing_file_is_one_line_in_both_spellings(tmp_path, capsys, monkeypatch, spelling):
    from vae_ddp.cli import main

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    code = main(["audit", *spelling, "--data", f"{M}.Regression", "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "nowhere.py does not exist" in err, err


def test_the_reduction_check_reads_several_seeded_batches(monkeypatch):
    """A mean over tokens per rank equals the global mean on a batch whose chunks hold as many
    tokens each (one random first batch in 8 here: the check flickered). The one-process check
    reads the first global batches of the loader, drawn from the audit's seed."""
    from examples.audit_models import MaskedTokens, Plain, Regression
    from vae_ddp.audit.preflight import check
    from vae_ddp.audit.spec import AuditRun

    monkeypatch.chdir(ROOT)
    for seed in range(8):
        run = AuditRun(model={"class_path": f"{M}.MaskedTokens"}, data={"class_path": f"{M}.Regression"},
                       devices=2, global_batch_size=16, seed=seed)
        assert [f["factor"] for f in check(run, Regression, MaskedTokens)[0]] == ["reduction"], seed
    assert check(run, Regression, Plain) == ([], [])


@pytest.mark.parametrize("model, kind, evidence, fix", [
    ("MaskedTokens", "weighted", "a number of items that differs per rank", "global_token_cross_entropy"),
    ("SummedLoss", "sum", "a sum over the batch", "multiply the summed loss by the world size"),
    ("LocalNegatives", "coupled", "depends on the other samples of its batch", "self.all_gather(z, sync_grads=True)"),
])
def test_the_reduction_check_names_the_fix_of_its_kind(model, kind, evidence, fix, monkeypatch):
    """A mean over a variable number of tokens, a sum over the batch and in-batch negatives each
    differ from a per-sample mean; the least-squares weights of the chunks' gradients tell them
    apart, and each gets the fix that reproduces one device (the summed-loss and in-batch
    negatives question pages measure those)."""
    import examples.audit_models as models
    from vae_ddp.audit.preflight import check
    from vae_ddp.audit.spec import AuditRun

    monkeypatch.chdir(ROOT)
    run = AuditRun(model={"class_path": f"{M}.{model}"}, data={"class_path": f"{M}.Regression"}, devices=2,
                   global_batch_size=16)
    findings, _ = check(run, models.Regression, getattr(models, model))
    f = {x["factor"]: x for x in findings}["reduction"]
    assert f["kind"] == kind and evidence in f["evidence"] and fix in f["fix"], f


def test_the_reduction_check_is_not_fooled_by_draws_in_the_step(monkeypatch):
    """`torch.randn_like` in training_step, a plain mean loss: the batch and its chunks draw
    different noise, so their gradients differ whatever the reduction (it was flagged as an
    in-batch loss, "coupled"). Two seeds tell: a note that the check was skipped, no finding."""
    from examples.audit_models import NoisyStep, Regression
    from vae_ddp.audit.preflight import check
    from vae_ddp.audit.spec import AuditRun

    monkeypatch.chdir(ROOT)
    run = AuditRun(model={"class_path": f"{M}.NoisyStep"}, data={"class_path": f"{M}.Regression"}, devices=2,
                   global_batch_size=16)
    findings, notes = check(run, Regression, NoisyStep)
    # the draw itself is named for the compared runs to key (not a finding of a factor)
    assert findings == [{"attention_layers": [],
                         "torch_draws": ["torch.randn_like in the LightningModule (NoisyStep)"]}]
    assert len(notes) == 1 and "changes with torch's seed" in notes[0], (findings, notes)


def test_random_draws_in_the_collate_fn_are_named(monkeypatch):
    """Mixup in the loader's collate_fn: the one-process check names it (the training step
    itself draws nothing, so DDPAudit's draw check cannot see it)."""
    from examples.audit_models import Mixup, Plain, Regression
    from vae_ddp.audit.preflight import check
    from vae_ddp.audit.spec import AuditRun

    monkeypatch.chdir(ROOT)
    run = AuditRun(model={"class_path": f"{M}.Plain"}, data={"class_path": f"{M}.Mixup"}, devices=2,
                   global_batch_size=16)
    findings, _ = check(run, Mixup, Plain)
    assert [f["factor"] for f in findings] == ["noise"] and "collate_fn" in findings[0]["evidence"], findings
    assert check(run, Regression, Plain) == ([], [])


def test_the_page_states_the_audit_rules():
    """The numbers docs/audit.md gives for the verdict are the constants the audit uses."""
    from vae_ddp.audit.study import ROUNDING_EPS

    page = (ROOT / "docs" / "audit.md").read_text()
    words = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 8: "eight"}
    assert f"({ROUNDING_EPS:g} machine epsilons)" in page
    assert f"{words[FLOOR_DRAWS]} draws" in page
    assert f"within {FLOOR_RATIO:g}x the floor's largest draw" in page
    from vae_ddp.audit.spec import DDP_STRATEGIES, TRAINER_ARGS

    flat = " ".join(page.split())
    from vae_ddp.fixes.sampler import SHAPE_BATCHES

    assert f"compared over the first {SHAPE_BATCHES} batches" in flat  # DDPAudit's batch shapes
    assert all(f"`--trainer.{a}`" in flat for a in TRAINER_ARGS) and all(f"`{s}`" in flat for s in DDP_STRATEGIES[:2])


def test_help_answers_without_torch():
    """`vae-ddp audit --help` imports neither torch nor Lightning (seconds to import on 2 cores):
    its parser takes the class paths as plain strings (benchmarks/audit_time.py times it)."""
    import subprocess

    # through the command's entry (``vae-ddp`` is ``vae_ddp.cli:entry``), which may import before main runs
    code = ("import sys; from vae_ddp.cli import entry; sys.argv = ['vae-ddp', 'audit', '--help']\n"
            "try:\n    entry()\nexcept SystemExit as e:\n    rc = e.code\n"
            "print(rc, sorted(m for m in ('torch', 'pytorch_lightning', 'lightning') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "0 []", proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "--trainer NAME VALUE" in proc.stdout and "exit codes: 0" in " ".join(proc.stdout.split())


def test_the_help_parser_has_every_option_of_the_parser():
    """One parser answers --help and parses (no second parser for the help): every option it
    parses is in its help; the Trainer arguments the help names are Lightning's, and those it
    refuses are not among them."""
    import inspect
    import io

    from pytorch_lightning import Trainer

    from vae_ddp.audit.cli import build_parser
    from vae_ddp.audit.spec import TRAINER_ARGS, TRAINER_SET

    parser, text = build_parser(), io.StringIO()
    parser.print_help(text)
    flat = " ".join(text.getvalue().split())
    options = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    assert {"--model", "--data", "--model.help", "--config", "--trainer", "--steps"} <= options
    assert all(o in flat for o in options), [o for o in options if o not in flat]
    lightning = inspect.signature(Trainer).parameters
    assert set(TRAINER_ARGS) <= set(lightning) and set(TRAINER_SET) <= set(lightning)
    assert not set(TRAINER_ARGS) & set(TRAINER_SET)
    import re

    assert all(re.search(rf"\b{k}\b", flat) for k in [*TRAINER_ARGS, *TRAINER_SET])


def test_the_help_fits_a_screen_and_the_page_says_what_each_trainer_argument_does(monkeypatch):
    """``vae-ddp audit --help`` at 80 columns is at most 80 lines (it was 115-123: the text of every Trainer
    argument); what each ``--trainer.NAME`` does in the runs is on the audit page, every one named there."""
    import io

    from vae_ddp.audit.cli import build_parser
    from vae_ddp.audit.spec import TRAINER_ARGS, TRAINER_OVERRIDDEN, TRAINER_SET

    monkeypatch.setenv("COLUMNS", "80")
    text = io.StringIO()
    build_parser().print_help(text)
    assert len(text.getvalue().splitlines()) <= 80, len(text.getvalue().splitlines())
    assert "the 'Audit your own model' page" in " ".join(text.getvalue().split())
    page = " ".join((ROOT / "docs" / "audit.md").read_text().split())
    missing = [k for k in [*TRAINER_ARGS, *TRAINER_SET, *TRAINER_OVERRIDDEN] if f"`--trainer.{k}`" not in page]
    assert not missing, missing


def test_the_trainer_arguments_the_audit_refuses_are_those_its_runs_set(monkeypatch):
    """Every keyword the audit's runs give ``Trainer`` (``vae_ddp.audit.run.build``, with every fix
    on) is refused as ``--trainer.NAME`` but the three it takes from the user (strategy, precision,
    max_epochs) and those that do not change the comparison (``TRAINER_OVERRIDDEN``: accepted, replaced, noted);
    the other refused ones change which or how many steps are compared. ``sync_batchnorm``
    (the BatchNorm fix on GPUs) is the user's to give."""
    from vae_ddp.audit import run as audit_run
    from vae_ddp.audit.spec import TRAINER_OVERRIDDEN, TRAINER_SET, AuditRun
    from vae_ddp.fixes import registry

    seen = {}
    monkeypatch.setattr(audit_run, "Trainer", lambda **kwargs: seen.update(kwargs))
    monkeypatch.chdir(ROOT)
    run = AuditRun(model={"class_path": f"{M}.Plain"}, data={"class_path": f"{M}.Regression"}, devices=2,
                   global_batch_size=16, steps=1, fixes=list(registry.audit_fixable()))
    audit_run.build(run)
    # the user's too: use_distributed_sampler (False with a sampler of their own; the sampler fix sets it itself)
    set_by_runs = set(seen) - {"strategy", "precision", "max_epochs", "use_distributed_sampler", *TRAINER_OVERRIDDEN}
    assert set(TRAINER_OVERRIDDEN) <= set(seen) and not set(TRAINER_OVERRIDDEN) & set(TRAINER_SET)
    assert set_by_runs <= set(TRAINER_SET), set_by_runs - set(TRAINER_SET)
    steps = {"num_nodes", "min_steps", "max_time", "fast_dev_run", "overfit_batches"}
    assert set(TRAINER_SET) - set_by_runs == steps, set(TRAINER_SET) - set_by_runs


@pytest.mark.parametrize("accelerator", ["cpu", "gpu"])
def test_the_users_sync_batchnorm_is_kept_and_the_audits_own_fix_replaces_it(monkeypatch, accelerator):
    """``--trainer.sync_batchnorm true`` is the user's BatchNorm fix: each DDP run has it (on CPU as the
    ``GlobalSyncBatchNorm`` plugin, said in the run's notes; on GPUs as itself), one with the audit's own
    BatchNorm fix has that one only (Lightning refuses both at once), a one-device run neither."""
    from vae_ddp.audit import run as audit_run
    from vae_ddp.audit.spec import AuditRun
    from vae_ddp.fixes.batchnorm import GlobalSyncBatchNorm

    seen = {}
    monkeypatch.setattr(audit_run, "Trainer", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr(audit_run, "NOTES", [])
    monkeypatch.chdir(ROOT)
    base = AuditRun(model={"class_path": f"{M}.WithBatchNorm"}, data={"class_path": f"{M}.Regression"}, devices=2,
                    global_batch_size=16, steps=1, accelerator=accelerator, trainer={"sync_batchnorm": True})

    def syncs(run):
        seen.clear()
        audit_run.build(run)
        plugins = [p for p in seen.get("plugins", []) if isinstance(p, GlobalSyncBatchNorm)]
        return len(plugins) + int(seen.get("sync_batchnorm", False))

    assert syncs(base) == 1 and syncs(base.replace(fixes=["batchnorm"])) == 1
    assert syncs(base.replace(devices=1)) == 0
    assert syncs(base.replace(trainer={})) == 0
    if accelerator == "cpu":
        assert any(n.startswith("sync_batchnorm=True: on CPU") for n in audit_run.NOTES)
    else:
        assert audit_run.NOTES == []


def test_batchnorms_layer_sync_plugin_is_the_users_sync_batchnorm():
    """The audit's own advice on CPU, ``plugins=[GlobalSyncBatchNorm()]`` (an instance, a class path, a config's
    ``class_path``), or Lightning's ``TorchSyncBatchNorm``, is the BatchNorm fix ``sync_batchnorm=True`` stands for
    (it was refused: the audit sets the plugins); any other plugin is still refused."""
    from vae_ddp.audit import preflight
    from vae_ddp.errors import UserError
    from vae_ddp.fixes import GlobalSyncBatchNorm

    for plugins in ([GlobalSyncBatchNorm()], "vae_ddp.fixes.GlobalSyncBatchNorm",
                    [{"class_path": "pytorch_lightning.plugins.TorchSyncBatchNorm"}]):
        assert preflight.trainer_args({"plugins": plugins}) == {"sync_batchnorm": True}, plugins
    with pytest.raises(UserError, match=r"--trainer.plugins: the audit sets it \(the fixes; BatchNorm's LayerSync"):
        preflight.trainer_args({"plugins": ["lightning_fabric.plugins.environments.LightningEnvironment"]})


def test_a_lightning_cli_configs_trainer_settings_are_accepted_and_noted(monkeypatch, tmp_path):
    """A project's LightningCLI config as it is: ``seed_everything`` (the runs' seed), ``trainer.accelerator``,
    ``devices``, ``sync_batchnorm``,
    ``logger: false``, ``enable_checkpointing: false`` (each refused before, one try each) are accepted; those the
    audit replaces are named in the notes where they differ from its own (``devices: 4`` against 2 ranks)."""
    from vae_ddp.audit import preflight
    from vae_ddp.audit import run as audit_run
    from vae_ddp.audit.cli import build_parser

    config = tmp_path / "fit.yaml"
    config.write_text("seed_everything: 7\ntrainer:\n  accelerator: cpu\n  devices: 4\n  sync_batchnorm: true\n"
                      "  logger: false\n  enable_checkpointing: false\n  enable_progress_bar: true\n"
                      f"model:\n  class_path: {M}.WithBatchNorm\ndata:\n  class_path: {M}.Regression\n")
    monkeypatch.chdir(ROOT)
    run, _, _ = preflight.audit_run(build_parser().parse_args(["--config", str(config)]).as_dict())
    assert run.trainer == {"accelerator": "cpu", "devices": 4, "sync_batchnorm": True, "logger": False,
                           "enable_checkpointing": False, "enable_progress_bar": True}, run.trainer
    assert run.seed == 7
    seen = {}
    monkeypatch.setattr(audit_run, "Trainer", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr(audit_run, "NOTES", [])
    audit_run.build(run)
    assert seen["devices"] == 2 and seen["logger"] is False and seen["enable_progress_bar"] is False
    assert [n.partition(":")[0] for n in audit_run.NOTES] == [
        "sync_batchnorm=True", "trainer.devices=4", "trainer.enable_progress_bar=True"], audit_run.NOTES


def test_the_other_trainer_arguments_reach_every_run(monkeypatch):
    """A Trainer argument the audit does not set (``--trainer.limit_train_batches``) goes through
    as LightningCLI spells it, typed by ``Trainer``'s signature, into the runs' Trainer."""
    from vae_ddp.audit import preflight
    from vae_ddp.audit.cli import build_parser
    from vae_ddp.audit.run import build

    monkeypatch.chdir(ROOT)
    cfg = build_parser().parse_args(["--model", f"{M}.Plain", "--data", f"{M}.Regression", "--trainer.benchmark",
                                     "true", "--trainer.limit_train_batches", "3", "--trainer.max_epochs", "2"])
    run, _, _ = preflight.audit_run(cfg.as_dict())
    assert run.trainer == {"benchmark": True, "limit_train_batches": 3, "max_epochs": 2}, run.trainer
    trainer = build(run.replace(devices=1))[2]
    assert trainer.limit_train_batches == 3 and trainer.max_epochs == 2


def test_the_audit_deals_global_batches_through_the_strategy_hook(monkeypatch):
    """The audit's sampler fix reaches the user's training loader through Lightning's
    `Strategy.process_dataloader` (no method of the user's datamodule replaced): the loader the
    run trains on deals the global batches of the user's own batch sampler (GlobalBatchChunks over
    a BatchSampler of 16), workers start with forkserver, and without the fix the user's own
    sampler stays."""
    from torch.utils.data import BatchSampler, RandomSampler

    from vae_ddp.audit.run import build
    from vae_ddp.audit.spec import AuditRun
    from vae_ddp.fixes.sampler import GlobalBatchChunks
    from pytorch_lightning import Callback

    class Seen(Callback):
        def on_train_start(self, trainer, pl_module):
            self.loader = trainer.train_dataloader

    monkeypatch.chdir(ROOT)
    for fixes, sampler in ((["sampler"], GlobalBatchChunks), ([], RandomSampler)):
        run = AuditRun(model={"class_path": f"{M}.Plain"}, data={"class_path": f"{M}.Regression",
                                                                 "init_args": {"num_workers": 1}},
                       devices=1, global_batch_size=16, steps=1, dtype="float32", fixes=fixes)
        model, dm, trainer = build(run)
        seen = Seen()
        trainer.callbacks.append(seen)
        trainer.fit(model, datamodule=dm)
        assert "train_dataloader" not in vars(dm)
        if fixes:
            chunks = seen.loader.batch_sampler
            assert type(chunks) is sampler and type(chunks.batch_sampler) is BatchSampler, chunks
            assert chunks.batch_sampler.batch_size == 16 and [len(b) for b in chunks] == [16] * 4
        else:
            assert type(seen.loader.sampler) is sampler and seen.loader.batch_size == 16, seen.loader.sampler
        assert seen.loader.multiprocessing_context.get_start_method() == "forkserver"


def test_the_one_process_check_is_repeatable(monkeypatch):
    """The module the one-process check builds comes from the audit's seed, not from wherever torch's
    global generator stands: the same command gives the same evidence numbers (they differed between
    two runs of one command before), and the caller's generator is left where it was."""
    import examples.audit_models as models
    from vae_ddp.audit.preflight import check
    from vae_ddp.audit.spec import AuditRun

    monkeypatch.chdir(ROOT)
    run = AuditRun(model={"class_path": f"{M}.LocalNegatives"}, data={"class_path": f"{M}.Regression"}, devices=2,
                   global_batch_size=16)
    seen = []
    for state in (1, 2):
        torch.manual_seed(state)
        expected = torch.rand(())
        torch.manual_seed(state)
        seen.append(check(run, models.Regression, models.LocalNegatives))
        assert torch.rand(()) == expected
    assert seen[0] == seen[1] and seen[0][0], seen


def test_the_unused_parameter_check_leaves_the_module_as_it_found_it(monkeypatch):
    """The check steps the module on each rank's chunk: a step that writes its own state (a queue of
    keys, a moving average) is put back, so the one-process checks after it see the module as built."""
    import itertools
    from types import SimpleNamespace

    from vae_ddp.audit import preflight
    from vae_ddp.fixes.factor import cast_batch

    monkeypatch.syspath_prepend(str(ROOT))
    import examples.audit_models as models

    for cls in (models.KeyQueue, models.MovingAverage):
        m = cls().double()
        dm = models.Regression(batch_size=16)
        dm.setup("fit")
        batches = [cast_batch(b, torch.float64) for b in itertools.islice(dm.train_dataloader(), 2)]
        before = [t.clone() for t in [*m.parameters(), *m.buffers()]]
        preflight._unused_on_a_rank(cls, m, batches, SimpleNamespace(trainer={}, devices=2, global_batch_size=16))
        assert all(torch.equal(a, b) for a, b in zip(before, [*m.parameters(), *m.buffers()])), cls.__name__
