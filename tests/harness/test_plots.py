"""Figures a reader can read: every figure function, drawn on the committed results (or on a
small made-up run where no per-step data is committed), keeps all of its text inside the
figure, labels both axes of every panel and names every drawn series in a legend."""

from __future__ import annotations

import json
import math

import pytest
from helpers import ROOT, load_script
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

RESULTS = ROOT / "docs" / "results"


@pytest.fixture
def captured(monkeypatch):
    """The figures the functions save (``Figure.savefig`` still writes the file)."""
    figs = []
    save = Figure.savefig

    def savefig(self, *args, **kwargs):
        figs.append(self)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figs


def _texts(fig):
    """Every visible text a reader reads: titles, axis labels, legends, suptitle, notes."""
    out = [t for t in fig.texts if t.get_text()]
    if fig._suptitle is not None:
        out.append(fig._suptitle)
    for leg in fig.legends:
        out += [*leg.get_texts(), leg.get_title()]
    for ax in fig.axes:
        out += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        if ax.get_legend():
            out += [*ax.get_legend().get_texts(), ax.get_legend().get_title()]
    return [t for t in out if t.get_visible() and t.get_text()]


def check_readable(fig):
    canvas = FigureCanvasAgg(fig)  # the renderer savefig used (Figure() alone has no canvas to draw on)
    canvas.draw()
    r = canvas.get_renderer()
    W, H = fig.bbox.width, fig.bbox.height

    def inside(b, what):
        assert b.x0 >= -1 and b.y0 >= -1 and b.x1 <= W + 1 and b.y1 <= H + 1, \
            f"{what} lies outside the {W:.0f}x{H:.0f} figure: {b}"

    for t in _texts(fig):
        inside(t.get_window_extent(r), f"text {t.get_text()!r}")
    for ax in fig.axes:  # everything each panel draws, tick labels included
        inside(ax.get_tightbbox(r), f"panel {ax.get_title()!r}")
    for leg in fig.legends:
        inside(leg.get_window_extent(r), "legend")
    for ax in fig.axes:
        assert ax.get_xlabel().strip() and ax.get_ylabel().strip(), f"axis {ax.get_title()!r} lacks a label"
        # a title no wider than its axes (constrained layout does not shrink titles)
        if ax.get_title():
            assert ax.title.get_window_extent(r).width <= ax.get_window_extent(r).width * 1.05, ax.get_title()
    # every series drawn has a legend entry somewhere on the figure
    legend_texts = {t.get_text() for leg in fig.legends for t in leg.get_texts()}
    for ax in fig.axes:
        if ax.get_legend():
            legend_texts |= {t.get_text() for t in ax.get_legend().get_texts()}
    for ax in fig.axes:
        for artist in [*ax.lines, *ax.collections, *ax.containers]:
            label = artist.get_label()
            if label and not label.startswith("_"):
                assert label in legend_texts, f"{label!r} has no legend entry"


def _single(captured):
    assert len(captured) == 1
    return captured[0]


@pytest.mark.skipif(not (RESULTS / "long-horizon" / "long-horizon.json").is_file(), reason="not committed")
def test_long_horizon_figure(tmp_path, captured):
    from vae_ddp.studies.long_horizon import plot

    plot(json.loads((RESULTS / "long-horizon" / "long-horizon.json").read_text()), tmp_path / "f.png")
    check_readable(_single(captured))


@pytest.mark.skipif(not (RESULTS / "report-scale" / "report_scale.json").is_file(), reason="not committed")
def test_report_scale_figure(tmp_path, captured):
    from vae_ddp.studies.report_scale import plot

    r = json.loads((RESULTS / "report-scale" / "report_scale.json").read_text())
    plot(r, tmp_path / "f.png")
    fig = _single(captured)
    check_readable(fig)
    bias, ratio = fig.axes
    assert bias.get_xscale() == ratio.get_xscale() == "linear"  # 0.6x and 2.9x must look as different as they are
    assert "bias" in bias.get_xlabel() and "noise ratio" in ratio.get_xlabel()
    # every measured variant is a row, its estimate a dot inside its interval on both panels
    measured = [v["effect"]["gradient"] for v in r["variants"].values() if v.get("effect")]
    assert len(bias.get_yticklabels()) == len(measured)
    for ax, key in ((bias, "bias"), (ratio, "variance_ratio")):
        dots = sorted(line.get_xdata()[0] for line in ax.lines if line.get_marker() == "o")
        assert dots == pytest.approx(sorted(e[key] for e in measured))
    # the margins of 'other luck only' are shaded: [0, 0.5] sd of bias, [0.5, 2] of the noise ratio
    from vae_ddp.harness import effect as stats

    spans = [(round(p.get_x(), 6), round(p.get_x() + p.get_width(), 6)) for p in ratio.patches]
    assert (round(1 / stats.RATIO_MARGIN, 6), round(stats.RATIO_MARGIN, 6)) in spans
    assert any(list(line.get_xdata()) == [1, 1] for line in ratio.lines)  # no change: a noise ratio of 1


def _runs(configs, seeds=3, steps=20):
    return {c: [{"seed": s, "records": [{"step": k + 1, "kl": 0.01 + 0.001 * math.sin(k + s + i),
                                         "recon_loss": 0.5 / (k + 1) + 0.01 * s, "loss": 0.5 / (k + 1)}
                                        for k in range(steps)]} for s in range(seeds)]
            for i, c in enumerate(configs)}


def test_seed_figure_draws_one_band_per_configuration(tmp_path, captured):
    """The committed full study holds final values only, so the figure is drawn on made-up
    curves of the same shape: one mean line and one band per configuration, never one line
    per seed."""
    from vae_ddp.studies.seeds import STUDY_CONFIGS, plot

    configs = list(STUDY_CONFIGS)
    plot(_runs(configs, seeds=10), tmp_path / "seeds.png", "small VAE on imagefolder, global batch 64")
    fig = _single(captured)
    check_readable(fig)
    for ax in fig.axes:
        assert len(ax.lines) == len(configs)
        assert sum(isinstance(c, PolyCollection) for c in ax.collections) == len(configs)
    legend = " ".join(t.get_text() for leg in fig.legends for t in [*leg.get_texts(), leg.get_title()])
    assert all(c in legend for c in configs) and "SD" in legend


def test_curves_figure_says_validation_is_in_eval_mode(tmp_path, captured):
    from vae_ddp.harness.plots import plot_curves

    runs = _runs(["single", "ddp", "dp"], seeds=1)
    series = [(c, rs[0]["records"], rs[0]["records"][::5]) for c, rs in runs.items()]
    plot_curves(series, tmp_path / "curves.png", "small VAE on digits, global batch 64, 20 steps")
    fig = _single(captured)
    check_readable(fig)
    legend = " ".join(t.get_text() for leg in fig.legends for t in [*leg.get_texts(), leg.get_title()])
    assert "eval mode" in legend and "running statistics" in legend


def test_report_style_figure(tmp_path, captured):
    from vae_ddp.harness.plots import plot_report_style

    records = [{"label": c, **x, "logged_kl": x["kl"], "logged_recon_loss": x["recon_loss"]}
               for c, rs in _runs(["single", "ddp", "dp"], seeds=1, steps=40).items() for x in rs[0]["records"]]
    plot_report_style(records, ["single", "ddp", "dp"], tmp_path / "rs.png", "small VAE on digits")
    check_readable(_single(captured))


def test_committed_seed_study_figure_is_its_final_values(tmp_path, captured):
    """The committed full study's figure is drawn from its own seeds.json: per quantity, one
    dot per seed and one mean ±1 SD bar per configuration, every text inside the figure."""
    import json

    from helpers import ROOT
    from vae_ddp.studies.seeds import plot_finals

    r = json.loads((ROOT / "docs" / "results" / "seeds-full" / "seeds.json").read_text())
    plot_finals(r, tmp_path / "seeds-finals.png")
    fig = _single(captured)
    check_readable(fig)
    for ax in fig.axes:
        assert len(ax.containers) == len(r["configs"])  # one error bar per configuration
    assert (ROOT / "docs" / "results" / "seeds-full" / "seeds-finals.png").stat().st_size > 10_000


def _example(name: str, monkeypatch):
    """``examples/<name>.py`` as a module (the factor scripts import ``vae_ddp`` only)."""
    return load_script(f"examples/{name}.py", f"figure_{name}", monkeypatch)


@pytest.mark.parametrize("factor", ["batchnorm", "sampler", "reduction", "logging", "optimizer"])
def test_factor_figures(factor, generated, tmp_path, captured, monkeypatch):
    """Each factor page's figure, drawn from the JSON of the run the page shows."""
    _example(f"factor_{factor}", monkeypatch).plot(generated(f"factor_{factor}"), tmp_path / "f.png")
    check_readable(_single(captured))


def test_noise_figure(tmp_path, captured, monkeypatch):
    """The noise page's figure plots the draws themselves, which its JSON does not keep: drawn on
    made-up draws of the same shape (two ranks per noise mode)."""
    import torch

    mod = _example("factor_noise", monkeypatch)
    g = torch.Generator().manual_seed(0)
    eps = {m: [torch.randn(3, 32, 16, generator=g), torch.randn(3, 32, 16, generator=g)] for m in mod.MODES}
    mod.plot(eps, tmp_path / "f.png")
    check_readable(_single(captured))
