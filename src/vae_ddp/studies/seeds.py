"""The seed study: is the report's difference beyond run-to-run variance, or equivalent?

``vae-ddp seeds`` trains several seeds of each configuration (``single``, default ``ddp``,
``ddp+fixed`` with every fix on, ``dp``; ``ddp+per_rank`` on request) and compares the
final train and validation KL and reconstruction of each configuration with ``single``.
"Final train" is the mean over the last 10% of steps of the global-batch value; "final
validation" is the whole validation set with fixed noise.

The comparison ([`compare_metrics`][vae_ddp.harness.stats.compare_metrics]) is paired by
seed: run i of every configuration starts from ``seed_everything(i)`` and so from the same
initial weights as run i of ``single`` (DDP broadcasts rank 0's weights, drawn after the
same seeding). What the runs of one seed do not share: the reparameterization noise
(``single`` continues the global stream after drawing the weights; DDP reseeds it in
``setup_distributed``; ``ddp+fixed`` and ``dp`` draw from their own generators) and, except
for ``dp`` in its first epoch, the data order (``RandomSampler`` seeded from the global
stream vs ``DistributedSampler`` / ``GlobalBatchDistributedSampler`` seeded by the seed).
The pairing is valid whatever is shared (the seeds are independent draws); the more the
runs of one seed share, the more it narrows the interval (the measured correlation ``r``
is in the table).

For each configuration and quantity: the paired difference with its 95% interval and
p-value, an equivalence test (TOST) with a margin of ``margin_sd`` standard deviations of
``single``'s final values (one, by default: a shift smaller than the spread between seeds
of one configuration cannot be told from it in one pair of runs), the smallest difference
detectable with 80% power, Holm's correction over the quantities, and a verdict per
quantity: ``equivalent``, ``different`` or ``inconclusive``.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Literal

from matplotlib.figure import Figure

from vae_ddp.errors import UserError
from vae_ddp.harness.configs import RunSpec
from vae_ddp.harness.launch import launch_by_world_size
from vae_ddp.harness.stats import QUANTITIES, compare_metrics, finals, margin_interval, margin_level
from vae_ddp.harness.table import number

__all__ = ["seed_study", "analyse", "reanalyse", "render", "plot", "plot_finals", "verdict_lines", "STUDY_CONFIGS",
           "MARGIN_SD"]

STUDY_CONFIGS = ("single", "ddp", "ddp+fixed", "ddp+per_rank", "dp")
#: Default equivalence margin, in standard deviations (over seeds) of ``single``'s final values.
MARGIN_SD = 1.0
#: What run i of each configuration shares with run i of ``single`` (see the module docstring).
SHARED_WITH_SINGLE = {"ddp": "initial weights", "ddp+fixed": "initial weights", "ddp+per_rank": "initial weights",
                      "dp": "initial weights, data order of the first epoch"}


def _spec(base: RunSpec, name: str) -> RunSpec:
    if name == "ddp+fixed":
        return dataclasses.replace(base, config="ddp", label=name).exact()
    if name == "ddp+per_rank":
        return dataclasses.replace(base, config="ddp", noise="per_rank", label=name)
    return dataclasses.replace(base, config=name, label=name)


def seed_study(base: RunSpec, configs: list[Literal[STUDY_CONFIGS]], num_seeds: int, out_dir: Path,
               margin_sd: float = MARGIN_SD, reanalyse_only: bool = False) -> dict:
    """Run the study; write ``seeds.json``, ``seeds.md`` and ``tables.md`` (both the printed
    tables and verdicts) and ``seeds.png`` into ``out_dir``; return the JSON content
    (see [`analyse`][vae_ddp.studies.seeds.analyse]).

    Args:
        base: settings shared by every configuration (steps, data, global batch size, ...).
        configs: configurations to train, ``single`` included (any of :data:`STUDY_CONFIGS`).
        num_seeds: seeds 0 .. num_seeds - 1 of each configuration.
        out_dir: output folder.
        margin_sd: equivalence margin in standard deviations of single over seeds.
        reanalyse_only: train nothing; recompute the statistics from the per-seed values in
            ``out_dir/seeds.json`` (see [`reanalyse`][vae_ddp.studies.seeds.reanalyse]).

    Raises:
        UserError: unknown configuration name, ``single`` missing, fewer than 3 seeds, or a
            margin that is not positive.
    """
    if reanalyse_only:
        return reanalyse(out_dir, margin_sd)
    for c in configs:
        if c not in STUDY_CONFIGS:
            raise UserError(f"unknown configuration {c!r}: use any of {', '.join(STUDY_CONFIGS)}")
    if "single" not in configs:
        raise UserError("the seed study compares with 'single': include it in --configs")
    if num_seeds < 3:
        raise UserError(f"--num_seeds must be at least 3 for a paired test and a standard deviation, got {num_seeds}")
    if not margin_sd > 0:
        raise UserError(f"--margin_sd must be positive, got {margin_sd}")
    out_dir = Path(out_dir)
    seeds = list(range(num_seeds))
    val_every = base.val_every if base.val_every else base.steps
    specs = [_spec(dataclasses.replace(base, seeds=seeds, val_every=val_every), c).validate() for c in configs]
    runs, t0 = {}, time.perf_counter()
    # one launch: single and dp one after the other in one process, the ddp variants in forked ranks
    print(f"== {', '.join(s.label for s in specs)}: {num_seeds} seeds x {base.steps} steps each", flush=True)
    for spec, (result, _) in zip(specs, launch_by_world_size(specs, out_dir / "runs", quiet=True)):
        runs[spec.label] = result["runs"]
    print(f"   done in {(time.perf_counter() - t0) / 60:.1f} min", flush=True)
    runs = {s.label: runs[s.label] for s in specs}  # in the order of --configs
    summary = {}
    for c, rs in runs.items():
        assert [r["seed"] for r in rs] == seeds  # values are listed in seed order: the pairing
        ends = [finals(r["records"], r["val_records"][-1]) for r in rs]
        summary[c] = {q: {"values": [f[q] for f in ends]} for q in QUANTITIES}
    result = {"settings": dataclasses.asdict(specs[0]) | {"config": None, "label": None}, "configs": list(runs),
              "num_seeds": num_seeds, "summary": summary}
    result = analyse(result, margin_sd)
    out_dir.mkdir(parents=True, exist_ok=True)
    _plot(runs, out_dir / "seeds.png", base)
    plot_finals(result, out_dir / "seeds-finals.png")
    _write(result, out_dir)
    print(render(result))
    return result


def analyse(result: dict, margin_sd: float = MARGIN_SD) -> dict:
    """The statistics of a study from its per-seed final values (no training).

    ``result["summary"][config][quantity]["values"]`` holds one value per seed, in seed
    order. Returns a copy with, per configuration and quantity, ``mean`` and ``std`` and,
    for every configuration but ``single``, ``vs_single`` (the entry of
    [`compare_metrics`][vae_ddp.harness.stats.compare_metrics], paired by seed, margin
    ``margin_sd`` standard deviations of ``single``), plus ``margin_sd``, ``shared_with_single``,
    ``verdict`` (``{config: {quantity: "equivalent" | "different" | "inconclusive"}}``) and
    ``verdict_lines`` (one sentence per configuration).
    """
    out = {k: v for k, v in result.items() if k not in ("verdicts", "verdict", "verdict_lines")}
    values = {c: {q: list(e["values"]) for q, e in qs.items()} for c, qs in result["summary"].items()}
    ref = values["single"]
    margins = {q: margin_sd * statistics.stdev(v) for q, v in ref.items()}
    summary = {}
    for c, qs in values.items():
        summary[c] = {q: {"mean": statistics.fmean(v), "std": statistics.stdev(v), "values": v} for q, v in qs.items()}
        if c != "single":
            for q, e in compare_metrics(qs, ref, margins, pair=True).items():
                summary[c][q]["vs_single"] = e
    out.update(summary=summary, margin_sd=margin_sd,
               shared_with_single={c: SHARED_WITH_SINGLE[c] for c in summary if c != "single"})
    out["verdict"] = {c: {q: e["vs_single"]["verdict"] for q, e in qs.items()} for c, qs in summary.items()
                      if c != "single"}
    out["verdict_lines"] = verdict_lines(summary, margin_sd)
    return out


def reanalyse(out_dir: Path, margin_sd: float = MARGIN_SD) -> dict:
    """Recompute the statistics of a finished study from the per-seed values in
    ``out_dir/seeds.json`` and rewrite ``seeds.json``, ``seeds.md`` and ``tables.md``
    (``seeds.png`` and the per-seed values are kept). Returns the new JSON content.

    Raises:
        UserError: no ``seeds.json`` in ``out_dir``.
    """
    path = Path(out_dir) / "seeds.json"
    if not path.is_file():
        raise UserError(f"no seeds.json in {out_dir}: run the study there first (vae-ddp seeds --out {out_dir})")
    result = analyse(json.loads(path.read_text()), margin_sd)
    _write(result, Path(out_dir))
    print(render(result))
    return result


def _write(result: dict, out_dir: Path) -> None:
    from vae_ddp.harness.table import write_tables
    from vae_ddp.outputs import result_set

    markdown = render(result)
    with result_set(out_dir) as new:
        (new / "seeds.json").write_text(json.dumps(result, indent=1))
        (new / "seeds.md").write_text(markdown + "\n")
        write_tables(new, markdown)


_g = number


def _interval(e: dict, k: int) -> str:
    """``97.5% CI 0.001 to 0.002``: a comparison's interval at the level of Holm's correction over
    ``k`` quantities (``margin_interval``; 95% where it has no paired spread)."""
    ci = margin_interval(e, k)
    if ci is None:
        return f"95% CI {_g(e['ci_low'])} to {_g(e['ci_high'])}"
    return f"{margin_level(k)} CI {_g(ci[0])} to {_g(ci[1])}"


def render(result: dict) -> str:
    """The study's verdict lines, then its tables (Markdown), from its ``seeds.json`` content."""
    from vae_ddp.studies.long_horizon import STATISTICS_TITLE, comparison_table, statistics_table
    from vae_ddp.harness.table import format_table

    st, n = result["settings"], result["num_seeds"]
    rows = [[c, q, _g(e["mean"]), _g(e["std"])] for c, qs in result["summary"].items() for q, e in qs.items()]
    parts = [format_table(["config", "quantity", "mean", "std over seeds"], rows,
                          title=f"{st['model']} VAE, {st['data']}, {n} seeds x {st['steps']} steps, "
                                f"global batch {st['global_batch_size']}")]
    for c, qs in result["summary"].items():
        if c == "single":
            continue
        comparison = {q: e["vs_single"] for q, e in qs.items()}
        headers, rows = comparison_table(comparison, c, "single")
        parts.append(format_table(headers, rows, title=f"{c} vs single, paired by seed (shared: "
                                                         f"{result['shared_with_single'][c]})"))
        headers, rows = statistics_table(comparison, c, "single")
        title = f"{c} vs single: {STATISTICS_TITLE[0].lower()}{STATISTICS_TITLE[1:]}"
        parts.append(format_table(headers, rows, title=title))
    lines = "\n".join(f"- {v}" for v in result["verdict_lines"])
    head = (f"Verdict against single ({n} seeds, paired by seed; Holm over the {len(QUANTITIES)} quantities at 5%; "
            f"equivalence margin ±{result['margin_sd']:g} standard deviation of single over seeds):")
    return f"{head}\n\n{lines}\n\n" + "\n\n".join(parts)


def verdict_lines(summary: dict, margin_sd: float = MARGIN_SD) -> list[str]:
    """One sentence per configuration, from the verdicts of its quantities (chosen by the data)."""
    out = []
    for c, qs in summary.items():
        if c == "single":
            continue
        by = {v: [(q, e["vs_single"]) for q, e in qs.items() if e["vs_single"]["verdict"] == v]
              for v in ("equivalent", "different", "inconclusive")}
        parts = []
        if by["equivalent"]:
            parts.append("equivalent to single in " + ", ".join(
                f"{q} (within ±{_g(e['margin'])})" for q, e in by["equivalent"]))
        if by["different"]:
            parts.append("different from single in " + ", ".join(
                f"{q} ({e['diff'] / e['mean_b']:+.1%}, p = {e['p_holm']:.2g}"
                + (", smaller than the margin" if e["within_margin"] else "") + ")" for q, e in by["different"]))
        if by["inconclusive"]:
            parts.append("inconclusive in " + ", ".join(
                f"{q} ({_interval(e, len(QUANTITIES))} reaches beyond ±{_g(e['margin'])})"
                for q, e in by["inconclusive"]))
        out.append(f"{c}: " + "; ".join(parts))
    return out


def _plot(runs: dict, path: Path, base: RunSpec) -> None:
    """The study's figure (`plot` of its runs, titled with the settings)."""
    plot(runs, path, f"{base.model} VAE on {base.data}, global batch {base.global_batch_size}")


def plot_finals(result: dict, path: Path) -> None:
    """The final value of each quantity per configuration, from a ``seeds.json`` content: one
    dot per seed, and the mean with a ±1 seed-to-seed standard deviation bar per configuration
    (the values the study's tests compare)."""
    import numpy as np

    summary, configs = result["summary"], result["configs"]
    quantities = list(summary[configs[0]])
    fig = Figure(figsize=(13, 3.6), layout="constrained")
    axes = fig.subplots(1, len(quantities))
    rng = np.random.default_rng(0)  # horizontal jitter of the dots only
    for ax, q in zip(np.atleast_1d(axes), quantities):
        for i, c in enumerate(configs):
            v = np.array(summary[c][q]["values"])
            ax.scatter(i + rng.uniform(-0.12, 0.12, len(v)), v, s=10, color=f"C{i}", alpha=0.55, lw=0,
                       label=f"{c}: one dot per seed")
            sd = v.std(ddof=1) if len(v) > 1 else 0.0
            ax.errorbar(i + 0.3, v.mean(), yerr=sd, fmt="o", color=f"C{i}", ms=5, capsize=4,
                        label=f"{c}: mean ±1 SD over {len(v)} seeds")
        ax.set_xticks(range(len(configs)), configs, fontsize=8)
        ax.set(title=q.replace("_", " "), xlabel="configuration", ylabel="final value (linear scale)")
        ax.grid(alpha=0.3, axis="y")
    handles, labels = np.atleast_1d(axes)[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=7)
    st = result["settings"]
    fig.suptitle(f"{st['model']} VAE on {st['data']}, global batch {st['global_batch_size']}, "
                 f"{st['steps']} steps: final values, {result['num_seeds']} seeds")
    from vae_ddp.outputs import save_figure

    save_figure(fig, path)


def plot(runs: dict, path: Path, title: str = "") -> None:
    """Mean and ±1 standard deviation over seeds of each configuration's train curves: one
    line and one band per configuration (not one line per seed).

    ``runs`` maps a configuration to its runs, one per seed, each with ``records`` (dicts
    with ``step``, ``kl``, ``recon_loss``)."""
    import numpy as np

    fig = Figure(figsize=(13, 4.6), layout="constrained")
    axes = fig.subplots(1, 2)
    for i, (c, rs) in enumerate(runs.items()):
        steps = [x["step"] for x in rs[0]["records"]]
        for ax, key in zip(axes, ("kl", "recon_loss")):
            y = np.array([[x[key] for x in r["records"]] for r in rs])
            m, s = y.mean(0), y.std(0, ddof=1) if len(rs) > 1 else np.zeros(len(steps))
            ax.plot(steps, m, color=f"C{i}", lw=1.4, label=f"{c}: mean of {len(rs)} seeds")
            ax.fill_between(steps, m - s, m + s, color=f"C{i}", alpha=0.18, lw=0,
                            label=f"{c}: ±1 SD over seeds")
    axes[0].set(title="train KL term (global batch)", ylabel="KL x kl_coeff, batch mean (linear scale)")
    axes[1].set(title="train reconstruction (global batch)", ylabel="MSE, mean over pixels (linear scale)")
    for ax in axes:
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=8,
               title="line: mean over seeds\nband: ±1 seed-to-seed SD", title_fontsize=8)
    if title:
        fig.suptitle(title)
    from vae_ddp.outputs import save_figure

    save_figure(fig, path)
