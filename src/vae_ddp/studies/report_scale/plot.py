"""The report-scale study's figure, ``report_scale.png``."""

from __future__ import annotations

import math
from pathlib import Path

from vae_ddp.studies.report_scale.variants import VARIANTS


def plot(result: dict, path: Path) -> Path:
    """Where each variant's effect is measured (``effect``), its bias (in one device's step-to-step
    standard deviations) and noise ratio on the gradient with their intervals, the margins of
    ``same distribution`` shaded; else horizontal bars of each variant's gradient ratio to batch noise."""
    from matplotlib.figure import Figure

    from vae_ddp.harness import effect as stats
    from vae_ddp.outputs import save_figure

    s = result["settings"]
    title = (f"One step from the same weights:\n{s['model']} VAE, {s['data']}, global batch {s['global_batch_size']} "
             f"({s['world_size']} ranks x {s['global_batch_size'] // s['world_size']})")
    measured = [(f"{VARIANTS[n][2] if n in VARIANTS else v['factor']}", v["effect"]["gradient"])
                for n, v in result["variants"].items() if v.get("effect")]
    if measured:
        fig = Figure(figsize=(7.2, 0.45 * len(measured) + 2.6), layout="constrained")
        axb, axr = fig.subplots(1, 2, sharey=True)
        y = list(range(len(measured)))[::-1]
        for ax, key, margin in ((axb, "bias", (0, stats.BIAS_MARGIN)),
                                (axr, "variance_ratio", (1 / stats.RATIO_MARGIN, stats.RATIO_MARGIN))):
            ci = [e[f"{key}_ci"] for _, e in measured]
            val = [e[key] for _, e in measured]
            hi_cap = max([c[1] for c in ci if math.isfinite(c[1])] + [margin[1]]) * 1.15
            for yi, v, (lo, hi) in zip(y, val, ci):
                ax.plot([lo, min(hi, hi_cap)], [yi, yi], color="C0", lw=2)
                ax.plot([v], [yi], "o", color="C0")
                if not math.isfinite(hi):
                    ax.annotate("", (hi_cap, yi), (hi_cap * 0.9, yi), arrowprops={"arrowstyle": "->", "color": "C0"})
            ax.axvspan(*margin, color="C2", alpha=0.15, label="margin of 'other luck only'")
            ax.axvline(0 if key == "bias" else 1, color="k", lw=0.8)
            ax.set_xlim(0 if key == "bias" else 0, hi_cap)
            ax.grid(axis="x", alpha=0.3)
        axb.set_yticks(y, [m[0] for m in measured], fontsize=8)
        axb.set_xlabel("bias of DDP's gradient\n(one device's step-to-step sd)", fontsize=8)
        axr.set_xlabel("noise ratio: DDP's variance\nover one device's", fontsize=8)
        axb.set_ylabel("factor left as Lightning's default", fontsize=8)
        axr.set_ylabel("factor (the rows on the left)", fontsize=8)
        axb.legend(loc="lower right", fontsize=7)
        fig.suptitle(title + f",\n{s['effect_batches']} global batches; dots: estimate, lines: "
                     f"{stats.CONFIDENCE:.0%} interval", fontsize=9)
        save_figure(fig, path)
        return path
    grad = [(f"{name}\n({v['factor']})", v["ratio_to_batch_noise"]["all"]) for name, v in result["variants"].items()]
    n = len(grad)
    fig = Figure(figsize=(7.2, 0.6 * n + 2.0), layout="constrained")
    ax = fig.subplots()
    y = list(range(n))[::-1]
    bars = ax.barh(y, [r[1] for r in grad], color="C0")
    ax.bar_label(bars, fmt="%.3g", padding=3, fontsize=8)
    ax.set_yticks(y, [r[0] for r in grad], fontsize=8)
    ax.axvline(1.0, color="k", ls="--", lw=1)
    ax.set_xlim(0, max(1.15, 1.1 * max(r[1] for r in grad)))
    ax.set_xlabel("gradient difference / batch-to-batch noise of one device (1.0: another batch)")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    save_figure(fig, path)
    return path
