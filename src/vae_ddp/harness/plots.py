"""Matplotlib figures of the studies (PNG files).

Figures are built with ``matplotlib.figure.Figure`` (no pyplot, no global backend), so
importing this module or calling it changes nothing in the caller's matplotlib state."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from matplotlib.figure import Figure

METRICS = ("loss", "kl", "recon_loss")
TITLES = {"loss": "loss", "kl": "KL term (x kl_coeff)", "recon_loss": "reconstruction (MSE)"}


VAL_NOTE = ("validation (dashed, markers) runs in eval mode: BatchNorm uses its running statistics, "
            "which lag the training batches early on")
YLABELS = {"loss": "loss (reconstruction + KL term)", "kl": "KL x kl_coeff (batch mean)",
           "recon_loss": "MSE (mean over pixels)"}


def plot_curves(series: Iterable[tuple[str, list[dict], list[dict]]], path: Path, title: str = "") -> Path:
    """One column per metric; each series is ``(label, train_records, val_records)``. Training
    curves (lines) in the top row, validation points (markers) in the bottom row, each row with its
    own scale, so that validation, computed in eval mode with BatchNorm's running statistics and
    often far from training early on, does not squeeze the training curves; the legend, below the
    panels, says so."""
    series = list(series)
    has_val = any(val for _, _, val in series)
    fig = Figure(figsize=(10, 6.4 if has_val else 3.8), layout="constrained")
    grid = fig.subplots(2 if has_val else 1, 3, sharex=True, squeeze=False)
    for i, (label, train, val) in enumerate(series):
        color = f"C{i}"
        for j, m in enumerate(METRICS):
            grid[0][j].plot([r["step"] for r in train], [r[m] for r in train], color=color, lw=1.2,
                            label=f"{label}: train (batch statistics)")
            if val:
                grid[1][j].plot([r["step"] for r in val], [r[m] for r in val], "o--", color=color, ms=4,
                                label=f"{label}: validation (eval mode, BatchNorm running statistics)")
    for row, name in zip(grid, ("training", "validation")):
        for ax, m in zip(row, METRICS):
            ax.set_title(f"{TITLES[m]}, {name}", fontsize=9)
            ax.set_ylabel(YLABELS[m], fontsize=8)
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
    for ax in grid.flat:
        ax.set_xlabel("optimizer step", fontsize=8)
    handles, labels = [], []
    for row in grid:
        h, lab = row[0].get_legend_handles_labels()
        handles += h
        labels += lab
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=max(1, len(series)), fontsize=8,
                   title=VAL_NOTE if has_val else None, title_fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    from vae_ddp.outputs import save_figure

    save_figure(fig, path)
    return path


def rolling(values: list[float], window: int) -> tuple[list[float], list[float]]:
    """Centred rolling mean and standard deviation (windows shrink at the ends)."""
    import statistics

    h = window // 2
    means, stds = [], []
    for i in range(len(values)):
        w = values[max(0, i - h):i + h + 1]
        means.append(statistics.fmean(w))
        stds.append(statistics.pstdev(w) if len(w) > 1 else 0.0)
    return means, stds


def plot_report_style(records: list[dict], configs: list[str], path: Path, title: str = "") -> Path:
    """The report's view beside the global-batch view.

    Top row: the training KL term and reconstruction as Lightning logged them with the
    report's logging (``self.log(..., on_step=True)``, no ``sync_dist``: under DDP rank 0's
    share of the batch); bottom row: the same terms over the whole global batch. Each
    configuration is drawn as its rolling mean (line) and rolling standard deviation
    (band), over a window of about a tenth of the steps.
    """
    fig = Figure(figsize=(12, 7), layout="constrained")
    axes = fig.subplots(2, 2, sharex=True)
    steps_max = max(r["step"] for r in records)
    window = max(3, steps_max // 10)
    for i, label in enumerate(configs):
        recs = [r for r in records if r["label"] == label]
        x = [r["step"] for r in recs]
        for col, m in enumerate(("kl", "recon_loss")):
            for row, key in enumerate((f"logged_{m}", m)):
                vals = [r[key] for r in recs]
                if any(v is None for v in vals):
                    continue
                mean, std = rolling(vals, window)
                ax = axes[row][col]
                ax.plot(x, mean, color=f"C{i}", lw=1.5, label=label)
                ax.fill_between(x, [a - b for a, b in zip(mean, std)], [a + b for a, b in zip(mean, std)],
                                color=f"C{i}", alpha=0.2, lw=0)
    for col, m in enumerate(("kl", "recon_loss")):
        axes[0][col].set_title(f"{TITLES[m]}: as logged (report's logging)")
        axes[1][col].set_title(f"{TITLES[m]}: whole global batch")
        for row in range(2):
            axes[row][col].set_ylabel(YLABELS[m])
            axes[row][col].set_xlabel("optimizer step")
            axes[row][col].grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, title=f"rolling mean and std over {window} steps", title_fontsize=8)
    if title:
        fig.suptitle(title)
    from vae_ddp.outputs import save_figure

    save_figure(fig, path)
    return path
