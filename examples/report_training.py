"""The report's three configurations trained at the report's model and batch on a CPU: does a KL gap appear?

One device (global batch 256), Lightning 1.x DP (emulated, 2 replicas) and DDP (2 ranks x 128), the
ResNet-18 VAE, Adam at lr 1e-4, Lightning's defaults, from the same seed and initial weights, each seed a
``vae-ddp compare`` run into ``OUT/seed-S/`` (``results.json``: what Lightning logged and the global
batch's value at every step; ``report_style.png``: the curves as the report plotted them beside the
global batch's; one device's final weights in ``runs/``). A seed whose ``results.json`` exists is not
trained again: the study resumes where it stopped, across sessions. ``times.json`` keeps each seed's
wall time; ``kl_steps.png`` plots every seed's KL at every step, as logged and over the global batch, on a
log scale (single steps can be orders of magnitude above the rest).

The summary (``summary.json``, ``summary.md``) reads the KL as the report plotted it (rank 0's logged
value for DDP, one replica's for DP) and over the global batch: each configuration's final KL (the mean
over the last ``--last`` steps), its gap to one device's per seed, the mean gap over the seeds with its
95% interval (Student's t over the seeds), and the smallest gap this study could have seen (the
interval's half-width: a gap smaller than that is not told from none by these seeds and steps), and each
configuration's largest KL over the global batch with its step (``peaks``).

    python examples/report_training.py --data_dir DIR --seeds 0 1 --steps 40 --out docs/results/report-training
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

CONFIGS = ("single", "ddp", "dp")
CURVES = {"logged": "logged_kl", "global batch": "kl"}


def final_kl(records: list[dict], config: str, key: str, last: int) -> float:
    """The mean of ``key`` over the last ``last`` steps of ``config``'s records."""
    values = [r[key] for r in records if r["config"] == config and r.get(key) is not None]
    return statistics.fmean(values[-last:])


def summarise(out: Path, seeds: list[int], last: int) -> dict:
    """The KL gaps of the seeds trained so far (``{"seeds", "last", "final", "gaps"}``): per curve (logged,
    global batch) and configuration, the final KL per seed; per configuration against one device, the gap
    per seed, its mean, the 95% interval's half-width over the seeds (None with one seed) and the gap
    relative to one device's final KL."""
    from scipy import stats

    done = [s for s in seeds if (out / f"seed-{s}" / "results.json").is_file()]
    records = {s: json.loads((out / f"seed-{s}" / "results.json").read_text())["records"] for s in done}
    final = {curve: {c: [final_kl(records[s], c, key, last) for s in done] for c in CONFIGS}
             for curve, key in CURVES.items()}
    gaps = {}
    for curve in CURVES:
        for c in ("ddp", "dp"):
            d = [a - b for a, b in zip(final[curve][c], final[curve]["single"])]
            half = (float(stats.t.ppf(0.975, len(d) - 1)) * statistics.stdev(d) / math.sqrt(len(d))
                    if len(d) > 1 else None)
            level = statistics.fmean(final[curve]["single"]) if d else None
            gaps[f"{c}, {curve}"] = {"per_seed": d, "mean": statistics.fmean(d) if d else None,
                                     "half_width": half, "relative": (statistics.fmean(d) / level) if d else None,
                                     "smallest_relative": (half / level) if half is not None else None}
    peaks = {c: [list(max(((r["kl"], r["step"]) for r in records[s] if r["config"] == c), default=()))
                 for s in done] for c in CONFIGS}
    steps = min((max(r["step"] for r in records[s]) for s in done), default=0)  # steps count from 1
    return {"seeds": done, "steps": steps, "last": last, "final": final, "gaps": gaps, "peaks": peaks}


def plot(out: Path, seeds: list[int]) -> Path:
    """``OUT/kl_steps.png``: the KL (x kl_coeff) at every step of every seed trained so far, as Lightning
    logged it (left) and over the global batch (right), one colour per configuration, one line style per
    seed, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [s for s in seeds if (out / f"seed-{s}" / "results.json").is_file()]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    styles = ["-", "--", ":", "-."]
    for ax, (curve, key) in zip(axes, CURVES.items()):
        for k, s in enumerate(done):
            records = json.loads((out / f"seed-{s}" / "results.json").read_text())["records"]
            for c, colour in zip(CONFIGS, ("C0", "C1", "C2")):
                rows = [(r["step"], r[key]) for r in records if r["config"] == c and r.get(key) is not None]
                ax.plot([a for a, _ in rows], [b for _, b in rows], styles[k % 4], color=colour, lw=1.2,
                        label=f"{c}, seed {s}")
        ax.set_yscale("log")
        ax.set_xlabel("optimizer step")
        ax.set_title(f"KL x kl_coeff, {curve}" + (" (rank 0's / one replica's rows)" if curve == "logged" else ""))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("KL x kl_coeff (batch mean, log scale)")
    axes[1].legend(fontsize=8, ncol=2)
    fig.suptitle("The report's three configurations, ResNet-18 VAE, global batch 256 (DDP 2 x 128), CPU")
    fig.tight_layout()
    path = out / "kl_steps.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render(summary: dict, steps: int, times: dict) -> str:
    """The summary as a Markdown table and the sentences under it."""
    n = len(summary["seeds"])
    lines = [f"KL after {steps} steps (the mean over the last {summary['last']}), {n} seed(s), against one device:",
             "", "| configuration, curve | gap per seed | mean gap (share of one device's KL) "
             "| smallest gap it could see |",
             "|---|---|---|---|"]
    for name, g in summary["gaps"].items():
        per = ", ".join(f"{v:+.3g}" for v in g["per_seed"]) or "-"
        mean = f"{g['mean']:+.3g} ({g['relative']:+.1%})" if g["mean"] is not None else "-"
        small = (f"{g['half_width']:.3g} ({g['smallest_relative']:.1%})" if g["half_width"] is not None
                 else "needs 2 seeds")
        lines.append(f"| {name} | {per} | {mean} | {small} |")
    from vae_ddp.studies.answer import training_gap

    lines += ["", "Read by the rule of the answer (a gap where the mean lies outside its interval): "
              + "; ".join(f"{name}: {training_gap(summary, name)['words']}" for name in summary["gaps"])
              + "."]
    lines += ["", "Largest KL over the global batch: " + "; ".join(
        f"{c}: " + ", ".join(f"seed {s} {p[0]:.3g} at step {p[1]}"
                             for s, p in zip(summary["seeds"], summary["peaks"][c]) if p) for c in CONFIGS) + "."]
    if times:
        lines += ["", "Wall time per seed (three configurations): "
                  + ", ".join(f"seed {s}: {t / 60:.1f} min" for s, t in sorted(times.items()))]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_dir", required=True, help="an ImageFolder tree (the CIFAR-10 subset)")
    p.add_argument("--data", default="imagefolder", choices=["imagefolder", "cifar10", "digits"])
    p.add_argument("--model", default="resnet18", choices=["resnet18", "small"])
    p.add_argument("--global_batch_size", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--last", type=int, default=5, help="the final KL: the mean over this many last steps")
    p.add_argument("--out", type=Path, default=Path("runs/report-training"))
    args = p.parse_args(argv)
    if args.last < 1 or args.last > args.steps:
        p.error(f"--last must be between 1 and --steps ({args.steps}), got {args.last}")

    from vae_ddp.harness.configs import RunSpec
    from vae_ddp.studies.compare import compare

    args.out.mkdir(parents=True, exist_ok=True)
    times_file = args.out / "times.json"
    times = json.loads(times_file.read_text()) if times_file.is_file() else {}
    for seed in args.seeds:
        folder = args.out / f"seed-{seed}"
        if (folder / "results.json").is_file():
            print(f"seed {seed}: done before ({folder / 'results.json'})", flush=True)
            continue
        t0 = time.perf_counter()
        compare(RunSpec(data=args.data, data_dir=args.data_dir, model=args.model, devices=2,
                        global_batch_size=args.global_batch_size, steps=args.steps, seeds=[seed], val_every=0),
                list(CONFIGS), folder)
        times[str(seed)] = time.perf_counter() - t0
        times_file.write_text(json.dumps(times, indent=1))
    summary = summarise(args.out, args.seeds, args.last)
    text = render(summary, args.steps, times)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    (args.out / "summary.md").write_text(text)
    plot(args.out, args.seeds)
    print(text)
    return summary


if __name__ == "__main__":
    main()
