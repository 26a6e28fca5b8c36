"""The report of an audit opens with its verdict (#62): the exit code in words, each cause with its fix,
then the verdict's line; a factor that changes only which samples DDP takes reads as the luck it is.
Rendered from two audits' ``audit.json`` (tests/scripts/audit_*.json: ``vae-ddp audit`` of
examples/audit_models.py's WithBatchNorm, exit 1, and Plain, exit 0, on Regression), changed where a case
needs it."""

import copy
import json

import pytest
from helpers import ROOT

from vae_ddp.audit.render import headline, render, verdict_line
from vae_ddp.audit.verdict import Verdict

pytestmark = pytest.mark.timeout(60)

BATCHNORM = json.loads((ROOT / "tests" / "scripts" / "audit_batchnorm.json").read_text())
PLAIN = json.loads((ROOT / "tests" / "scripts" / "audit_plain.json").read_text())


def _lines(result: dict) -> list[str]:
    return render(Verdict.from_dict(result)).splitlines()


def _row(lines: list[str], name: str) -> str:
    return next(ln for ln in lines if ln.startswith(f"| {name} "))


def test_a_failing_report_opens_with_exit_1_its_causes_and_their_fixes():
    lines = _lines(BATCHNORM)
    assert lines[0] == "exit 1: DDP does not train one device's model as you run it, because of: BatchNorm statistics"
    assert lines[1] == ("- BatchNorm statistics. Fix: Trainer(sync_batchnorm=True) on GPUs; on CPU/gloo "
                        "Trainer(plugins=[vae_ddp.fixes.GlobalSyncBatchNorm()])")
    assert lines[2] == verdict_line(Verdict.from_dict(BATCHNORM)) and lines[2].startswith("- not passed as you run it")
    assert lines.count(lines[2]) == 1 and lines[3] == "" and lines[4].startswith("Audit of ")  # the evidence follows


def test_every_cause_is_named_in_the_order_of_exit_why():
    result = copy.deepcopy(BATCHNORM)
    noise = next(f for f in result["findings"] if f["factor"] == "noise")
    noise.update(exposed=True, mechanism="another model", fix="seed each rank differently")
    result["exit_why"] = ["batchnorm", "noise"]
    lines = _lines(result)
    assert lines[0].endswith("because of: BatchNorm statistics, Random streams per rank"), lines[0]
    assert lines[2] == "- Random streams per rank. Fix: seed each rank differently"
    # what else makes it 1 follows the factors, in the exit rule's words
    apart = "with every fix, DDP's step is not within 2x its floor: the gradient, 5x its floor"
    result["exit_why"] = ["batchnorm", apart]
    assert headline(Verdict.from_dict(result)).endswith(f"because of: BatchNorm statistics; {apart}")


def test_a_passing_report_opens_with_exit_0_and_what_the_study_shows():
    lines = _lines(PLAIN)
    assert lines[0] == ("exit 0: DDP trains one device's model as you run it: with the fixes it computes one device's "
                        "whole step, each part within 2x its floor; none of the exposed factors (Sampler and data "
                        "order) changes the gradient here")
    assert lines[1].startswith("- passed: ") and lines[2] == ""
    assert "match" not in lines[0]  # the rule of the verdicts' words: a result shown within its floor, never "matches"


def test_an_audit_that_cannot_judge_says_so_and_nothing_of_ddp():
    result = copy.deepcopy(BATCHNORM)
    result.update(deterministic=False, floor=3.1e-5, exit_why=["not judged: one device's own floor is not rounding"])
    lines = _lines(result)
    assert lines[0].startswith("exit 1: not judged: one device's own gradient changes by 3.1e-05 relative when the "
                               "samples inside its batches are permuted"), lines[0]
    assert "DDP does not" not in lines[0] and lines[1].startswith("- not judged: ")  # no fix offered as the cure


def test_a_factor_of_other_samples_reads_as_luck_not_as_a_multiple_of_the_floor():
    """Lightning's shuffling DistributedSampler in a passing audit: 0.693 of another data order read
    '0.693 (4.6e+13x floor)', alarming for a factor that does not change the model DDP trains."""
    result = copy.deepcopy(PLAIN)
    sampler = next(f for f in result["findings"] if f["factor"] == "sampler")
    sampler.update(contribution=0.693, bites=True, vs_batch_noise=1.0)
    lines = _lines(result)
    row = _row(lines, "Sampler and data order")
    assert "0.693: only which samples (luck)" in row and "floor" not in row, row
    assert lines[0].endswith("as you run it, it differs only in which samples it takes from one device's distribution "
                             "(Sampler and data order)"), lines[0]
    assert any("only which samples (luck): the factor changes only which samples" in ln for ln in lines)
    # a factor that changes the model DDP trains keeps its multiple of the floor
    assert "(7.5e+14x floor)" in _row(_lines(BATCHNORM), "BatchNorm statistics")
    assert "does not bite" in _row(_lines(BATCHNORM), "Sampler and data order")
