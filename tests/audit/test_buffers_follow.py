"""Buffers that differ only because of other rows (#48 item 4, the gallery's DCGAN): a generator's BatchNorm
statistics under DDP follow from the noise ``z`` every rank draws alike and from per-rank statistics; with the
audit's fixes for both they are one device's, so the audit names them as following from those rows, not as a
cause of their own with a fix of their own. Truth: ``tests/scripts/noise_buffers_truth.py`` (plain
torch.distributed on 2 gloo ranks, float64; it does not import vae_ddp), committed as its JSON, which `make test-full`
measures again (`slow`: CI checks the audit against the committed measurement and reruns one case of
`tests/scripts/stateful_truth.py`)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from vae_ddp import guard
from helpers import ROOT, imported_modules, same_measurement

EPS64 = torch.finfo(torch.float64).eps
SCRIPT = "tests/scripts/noise_buffers_truth.py"
TRUTH = ROOT / "tests/scripts/noise_buffers_truth.json"


@pytest.fixture(scope="module")
def truth() -> dict:
    return json.loads(TRUTH.read_text())


def test_the_ground_truth_script_does_not_use_vae_ddp():
    names = imported_modules(SCRIPT)
    assert names and not [m for m in names if m.startswith("vae_ddp")], names


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_committed_truth_is_what_the_script_measures(tmp_path, truth):
    out = tmp_path / "truth.json"
    proc = guard.run([sys.executable, str(ROOT / SCRIPT), str(out)], capture_output=True, text=True, timeout=300,
                     cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert same_measurement(json.loads(out.read_text()), truth), (out.read_text(), truth)


def test_the_truth_shows_the_buffers_follow_from_the_draws_and_batchnorm(truth):
    """Only the global batch's z with global BatchNorm gives one device's running statistics; either
    fix alone leaves them apart."""
    assert truth["floor"] < 10 * EPS64
    assert truth["global_z, global_batchnorm"] <= 10 * max(truth["floor"], EPS64), truth
    for way in ("per_rank_z, rank_batchnorm", "per_rank_z, global_batchnorm", "global_z, rank_batchnorm"):
        assert truth[way] > 1e-3, (way, truth)


@pytest.mark.timeout(400)
def test_buffers_that_follow_from_the_draws_are_not_named_a_cause(tmp_path, truth):
    from vae_ddp.cli import main_captured

    out = tmp_path / "audit"
    code, stdout, stderr = main_captured(["audit", "--model", "examples/audit_models.py:NoiseBatchNorm", "--data",
                                          "examples/audit_models.py:Regression", "--steps", "3", "--out", str(out)],
                                         cwd=ROOT)
    log = stdout + stderr
    result = json.loads((out / "audit.json").read_text())
    rows = {f["factor"]: f for f in result["findings"]}
    # DDP as run trains another model (the same z on every rank): exit 1, named by the draws, not the buffers
    assert code == 1 and not result["unexplained"] and "noise" in result["exit_why"], log[-3000:]
    assert "buffers" not in result["exit_why"], result["exit_why"]
    # the check's runs trained in the audit's one launch, decided there (the ddp+fixed run saw the draws
    # GlobalBatchRandomness does not serve): judging launches nothing
    assert {"single+keyed", "ddp+fixed-forced+keyed"} <= set(result["runs"]), result["runs"]
    assert "effect-fixed" in result["runs"] + list(result["same_runs"])  # the draws are left for the user's code
    assert sorted(p.name for p in (out / "runs").iterdir() if p.is_dir()) == ["ddp", "one-device"]
    check = result["buffers_check"]
    assert check["closed"] and check["rows"] == ["noise", "batchnorm"] and check["buffer_ratio"] <= 2, check
    assert check["gradient"] < 10 * EPS64, check  # the truth's "global_z, global_batchnorm": one device's
    b = rows["buffers"]
    assert b["exposed"] and b["follows"] == ["noise", "batchnorm"] and b["mechanism"] == "follows", b
    assert b["evidence"].startswith("follows from Random streams per rank and BatchNorm statistics, not a cause")
    assert b["fix"].startswith("none of its own") and "all-reduce" not in b["fix"], b["fix"]
    assert b["effect"] is None and b["left_after_fixes"] is None
    exposed = [f["factor"] for f in result["findings"] if f["exposed"]]
    assert exposed[0] == "noise" and exposed[-1] == "buffers", exposed  # never the headline
    assert "follows from Random streams per rank, BatchNorm statistics" in log
    verdict = next(ln for ln in log.splitlines() if ln.startswith("- not passed"))
    assert "only a change in your code fixes it: Random streams per rank (" in verdict, verdict


def test_a_row_that_follows_is_worded_so_and_never_first():
    """The rules on rows whose answer is known (no process started): a buffers row marked as following
    from the draws ranks after every other exposed row, says so in the table, and the verdict's list of
    what only your code fixes leaves it out; an ordinary buffers row stays "your code"."""
    from vae_ddp.audit import judge, render
    from vae_ddp.audit.verdict import Verdict

    v = {"deterministic": True, "grad_steps": [0.5], "batch_noise": 0.8, "yardstick": EPS64, "grad_within": False}
    noise = {"evidence": "z repeats", "fix": "global_batch_draw", "manual": True}
    follows = {"evidence": "follows from ...", "fix": "none of its own", "manual": True, "follows": ["noise"],
               "mechanism": "follows"}
    own = dict(follows, follows=None, mechanism=None, evidence="per-rank values", fix="all-reduce")
    for buffers, first in ((follows, "noise"), (own, None)):
        found = {"noise": noise, "buffers": buffers}
        rows = judge._rows(found, dict(found), {}, {}, v)
        for r in rows:
            r["effect"] = None
        ranked = [r for r in sorted(rows, key=judge._rank) if r["exposed"]]
        by = {r["factor"]: r for r in rows}
        result = Verdict(findings=ranked, deterministic=True, unexplained=False, within_floor=False,
                         dtype="float64", trainer={}, floor=EPS64, steps=3, global_batch_size=8, devices=2,
                         model={"class_path": "M"}, batch_noise=None, batch_noise_steps=[],
                         # what the table and the verdict's line do not read
                         floor_draws=[], grad_steps=[], ratio_to_floor=0.0, trajectory_floor=0.0,
                         divergence_default=0.0, divergence_fixed=0.0, largest_differences=[])
        table = "\n".join(render._render_table(result, render._Units(result)))
        verdict = render._render_verdict(result, render._Units(result))
        if first:
            assert by["buffers"]["follows"] == ["noise"] and ranked[-1]["factor"] == "buffers", ranked
            assert "follows from Random streams per rank" in table and "Buffers after the step" not in verdict
        else:
            assert by["buffers"]["follows"] is None and "follows from" not in table
            assert "Buffers after the step" in verdict, verdict
