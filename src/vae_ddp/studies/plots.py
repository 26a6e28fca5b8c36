"""Matplotlib figures of the studies (PNG files).

Figures are built with ``matplotlib.figure.Figure`` (no pyplot, no global backend), so
importing this module or calling it changes nothing in the caller's matplotlib state."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from matplotlib.figure import Figure

METRICS = ("loss", "kl", "recon_loss")
TITLES = {"loss": "loss", "kl": "KL term (x kl_coeff)", "recon_loss": "reconstruction (MSE)"}


def plot_curves(series: Iterable[tuple[str, list[dict], list[dict]]], path: Path, title: str = "") -> Path:
    """One panel per metric; each series is ``(label, train_records, val_records)``.
    Train curves are lines, validation points are markers on the same colour."""
    fig = Figure(figsize=(14, 4), layout="constrained")
    axes = fig.subplots(1, 3)
    for i, (label, train, val) in enumerate(series):
        color = f"C{i}"
        for ax, m in zip(axes, METRICS):
            ax.plot([r["step"] for r in train], [r[m] for r in train], color=color, lw=1.2, label=f"{label} train")
            if val:
                ax.plot([r["step"] for r in val], [r[m] for r in val], "o--", color=color, ms=4,
                        label=f"{label} val")
    for ax, m in zip(axes, METRICS):
        ax.set_title(TITLES[m])
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=110)
    return path
