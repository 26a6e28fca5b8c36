"""The seed study: is the report's difference beyond run-to-run variance?

``vae-ddp seeds`` trains several seeds of each configuration (``single``, default ``ddp``,
``ddp+fixed`` with every fix on, ``dp``; ``ddp+per_rank`` on request) and compares the
final train and validation KL and reconstruction of each configuration with ``single``:
means, standard deviations, the difference of means with its 95% confidence interval and
a two-sided Welch t-test (scipy). "Final train" is the mean over the last 10% of steps of
the global-batch value; "final validation" is the whole validation set with fixed noise.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

from matplotlib.figure import Figure

from vae_ddp.errors import UserError
from vae_ddp.studies.configs import RunSpec
from vae_ddp.studies.launch import launch
from vae_ddp.studies.stats import welch
from vae_ddp.studies.table import format_table, write_tables

__all__ = ["seed_study", "STUDY_CONFIGS"]

STUDY_CONFIGS = ("single", "ddp", "ddp+fixed", "ddp+per_rank", "dp")
QUANTITIES = ("train_kl", "train_recon_loss", "val_kl", "val_recon_loss")


def _spec(base: RunSpec, name: str) -> RunSpec:
    if name == "ddp+fixed":
        return dataclasses.replace(base, config="ddp", label=name).exact()
    if name == "ddp+per_rank":
        return dataclasses.replace(base, config="ddp", noise="per_rank", label=name)
    return dataclasses.replace(base, config=name, label=name)


def _finals(run: dict) -> dict[str, float]:
    recs = run["records"]
    n = max(1, len(recs) // 10)
    val = run["val_records"][-1]
    return {"train_kl": statistics.fmean(r["kl"] for r in recs[-n:]),
            "train_recon_loss": statistics.fmean(r["recon_loss"] for r in recs[-n:]),
            "val_kl": val["kl"], "val_recon_loss": val["recon_loss"]}


def seed_study(base: RunSpec, configs: list[str], num_seeds: int, out_dir: Path) -> dict:
    """Run the study; write ``seeds.json``, ``seeds.md`` and ``tables.md`` (both the printed table
    and verdicts) and ``seeds.png`` into ``out_dir``; return the JSON content.

    Raises:
        UserError: unknown configuration name, ``single`` missing, or fewer than 2 seeds.
    """
    for c in configs:
        if c not in STUDY_CONFIGS:
            raise UserError(f"unknown configuration {c!r}: use any of {', '.join(STUDY_CONFIGS)}")
    if "single" not in configs:
        raise UserError("the seed study compares with 'single': include it in --configs")
    if num_seeds < 2:
        raise UserError(f"--num-seeds must be at least 2 for a t-test, got {num_seeds}")
    out_dir = Path(out_dir)
    seeds = list(range(num_seeds))
    val_every = base.val_every if base.val_every else base.steps
    specs = [_spec(dataclasses.replace(base, seeds=seeds, val_every=val_every), c).validate() for c in configs]
    runs, t0 = {}, time.perf_counter()
    for i, spec in enumerate(specs):
        print(f"== {spec.label}: {num_seeds} seeds x {spec.steps} steps", flush=True)
        runs[spec.label] = launch(spec, out_dir / "runs" / spec.label, quiet=True)["runs"]
        elapsed = time.perf_counter() - t0
        print(f"   done; {elapsed / 60:.1f} min so far, about {elapsed / (i + 1) * (len(specs) - i - 1) / 60:.1f} "
              f"min to go", flush=True)
    finals = {c: [_finals(r) for r in rs] for c, rs in runs.items()}
    summary = {}
    for c in runs:
        summary[c] = {}
        for q in QUANTITIES:
            vals = [f[q] for f in finals[c]]
            entry = {"mean": statistics.fmean(vals), "std": statistics.stdev(vals), "values": vals}
            if c != "single":
                entry["vs_single"] = welch(vals, [f[q] for f in finals["single"]])
            summary[c][q] = entry
    result = {"settings": dataclasses.asdict(specs[0]) | {"config": None, "label": None}, "configs": list(runs),
              "num_seeds": num_seeds, "summary": summary, "verdicts": verdicts(summary)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "seeds.json").write_text(json.dumps(result, indent=1))
    _plot(runs, out_dir / "seeds.png", base)
    markdown = render(result)
    (out_dir / "seeds.md").write_text(markdown + "\n")
    write_tables(out_dir, markdown)
    print(markdown)
    return result


def render(result: dict) -> str:
    """The study's table and verdict lines (Markdown) from its ``seeds.json`` content."""
    rows = []
    for c, qs in result["summary"].items():
        for q, e in qs.items():
            w = e.get("vs_single", {})
            rows.append([c, q, e["mean"], e["std"], w.get("diff"),
                         None if not w else f"[{w['ci_low']:.2e}, {w['ci_high']:.2e}]", w.get("p")])
    st = result["settings"]
    table = format_table(["config", "quantity", "mean", "std", "diff vs single", "95% CI of diff", "Welch p"], rows,
                         title=f"{st['model']} VAE, {st['data']}, {result['num_seeds']} seeds x {st['steps']} steps, "
                               f"global batch {st['global_batch_size']}")
    lines = "\n".join(f"- {v}" for v in result["verdicts"])
    return f"{table}\n\nVerdict at the 5% level (two-sided Welch t-test against single):\n\n{lines}"


def verdicts(summary: dict, alpha: float = 0.05) -> list[str]:
    """One sentence per configuration: which final quantities differ from ``single`` beyond the
    run-to-run variance (Welch p < ``alpha``) and which do not."""
    out = []
    for c, qs in summary.items():
        if c == "single":
            continue
        differ = [f"{q} (p = {e['vs_single']['p']:.2g})" for q, e in qs.items() if e["vs_single"]["p"] < alpha]
        same = [q for q, e in qs.items() if not e["vs_single"]["p"] < alpha]
        if differ:
            text = f"{c}: differs from single beyond run-to-run variance in " + ", ".join(differ)
            text += f"; not detectably in {', '.join(same)}" if same else ""
        else:
            text = f"{c}: no difference from single detectable in any quantity (all p >= {alpha})"
        out.append(text)
    return out


def _plot(runs: dict, path: Path, base: RunSpec) -> None:
    fig = Figure(figsize=(13, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    for i, (c, rs) in enumerate(runs.items()):
        for j, r in enumerate(rs):
            steps = [x["step"] for x in r["records"]]
            for ax, key in zip(axes, ("kl", "recon_loss")):
                ax.plot(steps, [x[key] for x in r["records"]], color=f"C{i}", lw=0.7, alpha=0.6,
                        label=c if j == 0 else None)
    axes[0].set_title("train KL term (global batch), one line per seed")
    axes[1].set_title("train reconstruction (global batch), one line per seed")
    for ax in axes:
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{base.model} VAE on {base.data}, global batch {base.global_batch_size}")
    fig.savefig(path, dpi=110)
