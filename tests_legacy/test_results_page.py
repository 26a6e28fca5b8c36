"""examples/legacy/results/results.md (included by docs/legacy.md) is exactly what report.py
renders from the committed measurements: no number on the page is typed by hand."""

import shutil

from conftest import ROOT, run


def test_results_md_is_rendered_from_the_committed_json(tmp_path):
    src = ROOT / "examples" / "legacy" / "results"
    out = tmp_path / "results"
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("results.md"))
    proc = run(["examples/legacy/report.py", "--out", out, "--render-only"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "results.md").read_text() == (src / "results.md").read_text()


def test_results_md_holds_the_measured_facts():
    text = (ROOT / "examples" / "legacy" / "results" / "results.md").read_text()
    assert "| parameters | 20,057,088 | 20,057,088 |" in text
    assert "Lightning 1.9.5" in text and "`DistributedSamplerWrapper` around `RandomSampler`" in text


def test_report_needs_the_legacy_interpreter_or_out(tmp_path):
    proc = run(["examples/legacy/report.py"])
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "--out" in proc.stderr
    proc = run(["examples/legacy/report.py", "--out", tmp_path / "empty", "--render-only"])
    assert proc.returncode == 2 and "parity.json is missing" in proc.stderr
