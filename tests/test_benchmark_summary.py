"""The step-time benchmark's summary: paired ratios per round and a verdict only where every
round agrees (the arithmetic on given run medians; timing itself is a benchmark, not a test)."""


import pytest
from helpers import ROOT, load_script


@pytest.fixture(scope="module")
def bench():
    return _load("step_time")


def test_verdicts_need_every_round(bench):
    runs = {"ddp": [0.100, 0.200, 0.150],
            "ddp + slow": [0.150, 0.300, 0.225],      # 1.5x in every round
            "ddp + noisy": [0.090, 0.230, 0.150],     # 0.9x, 1.15x, 1.0x
            "ddp + quick": [0.050, 0.120, 0.060]}     # 0.5x, 0.6x, 0.4x
    s = bench.summarise(runs)
    assert s["ddp + slow"]["verdict"] == "slower" and s["ddp + slow"]["ratio_median"] == pytest.approx(1.5)
    assert s["ddp + noisy"]["verdict"] == "not resolved"
    assert s["ddp + noisy"]["ratio_min"] == pytest.approx(0.9) and s["ddp + noisy"]["ratio_max"] == pytest.approx(1.15)
    assert s["ddp + quick"]["verdict"] == "faster" and s["ddp + quick"]["ratio_median"] == pytest.approx(0.5)
    assert s["ddp"]["median_s"] == pytest.approx(0.150) and s["ddp"]["min_s"] == pytest.approx(0.100)
    settings = dict(global_batch_size=32, repeats=3, warmup=3, steps=12)
    text = bench.render("small", s, settings)
    flat = " ".join(text.split())
    assert "| ddp + noisy | 150 | 90 to 230 | 1.00 (0.90 to 1.15) | not resolved |" in flat
    assert "vary by up to 0.25 between rounds" in text and "load average" not in text
    assert "ddp + slow slower (1.50x); ddp + quick faster (0.50x)" in text


def _load(name: str):
    return load_script(f"benchmarks/{name}.py", f"{name}_bench")


@pytest.mark.parametrize("name, folder, page", [("step_time", "step-time", "recipe.md"),
                                                ("audit_overhead", "audit-overhead", "audit.md"),
                                                ("audit_false_alarms", "audit-false-alarms", "audit.md")])
def test_committed_benchmark_is_what_the_benchmark_renders(name, folder, page):
    """Timings are measured by `make bench` on an idle machine and committed under
    docs/results/ (the docs build would time them on a shared CPU): the page includes exactly
    what the benchmark renders from its own JSON, with the command that wrote it."""
    import json

    out = ROOT / "docs" / "results" / folder
    result = json.loads((out / f"{name}.json").read_text())
    bench = _load(name)
    rendered = bench.render_all(result) if name == "step_time" else bench.render(result)
    assert (out / "tables.md").read_text() == rendered + "\n"
    assert (out / "command.md").read_text() == bench.command_md(result, f"docs/results/{folder}")
    text = (ROOT / "docs" / page).read_text()
    assert f'--8<-- "docs/results/{folder}/tables.md"' in text
    assert f'--8<-- "docs/results/{folder}/command.md"' in text

