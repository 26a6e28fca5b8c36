"""The report-scale training study and the step equality from trained weights (examples/report_training.py,
examples/report_step_equality.py; run outside CI): the committed tables are what the scripts render from
the committed JSON, and "Is it a bug?" shows them."""

import importlib.util
import json

import pytest
from helpers import ROOT

TRAINING = ROOT / "docs" / "results" / "report-training"
EQUALITY = ROOT / "docs" / "results" / "step-equality"


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not (TRAINING / "summary.json").is_file(), reason="the training study is not committed")
def test_committed_training_study_is_what_the_script_renders():
    rt = _script("report_training")
    committed = json.loads((TRAINING / "summary.json").read_text())
    summary = rt.summarise(TRAINING, committed["seeds"], committed["last"])  # from the seeds' results.json
    assert summary == committed
    assert len(summary["seeds"]) >= 2 and summary["steps"] >= 40  # the study the issue asked for
    times = json.loads((TRAINING / "times.json").read_text())
    assert (TRAINING / "summary.md").read_text() == rt.render(summary, summary["steps"], times)
    assert (TRAINING / "kl_steps.png").is_file()
    assert not list(TRAINING.rglob("*.pt"))  # the weights stay out


@pytest.mark.skipif(not (EQUALITY / "summary.json").is_file(), reason="the step equality is not committed")
def test_committed_step_equality_is_what_the_script_renders():
    se = _script("report_step_equality")
    summary = json.loads((EQUALITY / "summary.json").read_text())
    assert set(summary["parts"]) == {"initial", "trained"}
    assert (EQUALITY / "summary.md").read_text() == se.render(summary)
    for part in ("initial", "trained"):
        eq = json.loads((EQUALITY / part / "equivalence.json").read_text())
        assert summary["parts"][part]["floor"] == eq["floor"]
        assert summary["parts"][part]["world_sizes"]["2"]["verdict"] == eq["world_sizes"]["2"]["verdict"]
        assert eq["single"]["model"] == "resnet18" and eq["single"]["global_batch_size"] == 256
        assert (eq["single"]["init_weights"] is None) == (part == "initial")
    trained = json.loads((TRAINING / "summary.json").read_text())
    assert summary["parts"]["trained"]["trained_steps"] == trained["steps"]


def test_is_it_a_bug_shows_both():
    page = (ROOT / "docs" / "is-it-a-bug.md").read_text()
    for include in ('--8<-- "docs/results/report-training/summary.md"',
                    '--8<-- "docs/results/step-equality/summary.md"', "results/report-training/kl_steps.png"):
        assert include in page, include


@pytest.mark.skipif(not (EQUALITY / "summary.json").is_file(), reason="the studies are not committed")
def test_both_scripts_resume_where_they_stopped(tmp_path, monkeypatch):
    """A seed whose results.json exists is not trained again, a part whose equivalence.json exists is not
    run again: the page's "Both resume where they stopped"."""
    import shutil

    import vae_ddp.studies.compare
    import vae_ddp.studies.equivalence

    def never(*args, **kwargs):
        raise AssertionError("trained again")

    monkeypatch.setattr(vae_ddp.studies.compare, "compare", never)
    monkeypatch.setattr(vae_ddp.studies.equivalence, "equivalence", never)
    training, equality = tmp_path / "report-training", tmp_path / "step-equality"
    shutil.copytree(TRAINING, training)
    shutil.copytree(EQUALITY, equality)
    weights = training / "seed-0" / "runs" / "1-process" / "0" / "params-0.pt"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"")
    summary = _script("report_training").main(["--data_dir", str(tmp_path), "--seeds", "0", "1", "--steps", "50",
                                                "--last", "10", "--out", str(training)])
    assert summary["seeds"] == [0, 1]
    done = _script("report_step_equality").main(["--data_dir", str(tmp_path), "--training", str(training),
                                                  "--out", str(equality)])
    assert set(done["parts"]) == {"initial", "trained"}
