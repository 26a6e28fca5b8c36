"""The main job: the three configurations of the report, trained side by side.

``vae-ddp compare`` trains ``single``, ``ddp`` and ``dp`` for K optimizer steps on the
same data, model, seed and global batch size, and writes ``results.json`` (one record per
configuration and step), ``curves.png``, ``report_style.png`` and its tables (printed and
written to ``tables.md``).

What the report plotted is what Lightning logged: ``self.log(..., on_step=True)`` without
``sync_dist``, which under DDP is rank 0's mean over its share of the batch, and under
Lightning 1.x DP one replica's (see [`vae_ddp.dp`][vae_ddp.dp]). Every
record keeps that value (``logged_*``) beside the value over the whole global batch, and
the study measures how much more the logged curve fluctuates than the global-batch one
(the spread ratio), for the KL term and for the reconstruction term, and why the KL term
shows it more: the per-sample relative variance ``var / mean^2`` of the one-sample Monte
Carlo KL estimate against that of the reconstruction error, on one global batch at the
single run's final weights.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Literal

from vae_ddp.harness.configs import CONFIGS, RunSpec
from vae_ddp.harness.launch import launch_by_world_size
from vae_ddp.harness.plots import plot_curves, plot_report_style
from vae_ddp.harness.table import format_table, write_tables

__all__ = ["co_movement", "compare", "write_results", "per_sample_relative_variance", "relative_spread", "spread_ratio"]


def _diff_std(values: list[float]) -> float:
    d = [b - a for a, b in zip(values, values[1:])]
    m = sum(d) / len(d)
    return (sum((x - m) ** 2 for x in d) / max(1, len(d) - 1)) ** 0.5


def spread_ratio(records: list[dict], metric: str = "kl") -> float | None:
    """Step-to-step spread of the logged curve over that of the global-batch curve.

    Spread: standard deviation of the differences between consecutive steps (the slow
    trend of training cancels out). 1: the logged curve is the global-batch curve; about
    sqrt(2) when the logged value is the mean of half the batch, independent of the other
    half. None with fewer than 3 steps or nothing logged.
    """
    logged = [r.get(f"logged_{metric}") for r in records]
    glob = [r[metric] for r in records]
    if len(records) < 3 or any(v is None for v in logged):
        return None
    g = _diff_std(glob)
    return _diff_std(logged) / g if g > 0 else None


def relative_spread(records: list[dict], metric: str = "logged_kl") -> float | None:
    """Step-to-step spread of a curve relative to its level: the standard deviation of the
    changes between consecutive steps over the mean value (how wiggly it looks on a plot
    of its own scale). None with fewer than 3 steps or nothing logged."""
    vals = [r.get(metric) for r in records]
    if len(vals) < 3 or any(v is None for v in vals):
        return None
    m = sum(vals) / len(vals)
    return _diff_std(vals) / abs(m) if m else None


def co_movement(records: list[dict], label: str, reference: str = "single", metric: str = "logged_kl") -> float | None:
    """Correlation of the step-to-step changes of ``metric`` between ``label`` and
    ``reference``: near 1 when the two curves wiggle together (the same batches in the same
    order), near 0 when their wiggles are independent. None with fewer than 4 steps."""
    a = [r[metric] for r in records if r["label"] == label]
    b = [r[metric] for r in records if r["label"] == reference]
    n = min(len(a), len(b))
    if n < 4 or any(v is None for v in a[:n] + b[:n]):
        return None
    da = [y - x for x, y in zip(a[:n], a[1:n])]
    db = [y - x for x, y in zip(b[:n], b[1:n])]
    ma, mb = sum(da) / len(da), sum(db) / len(db)
    cov = sum((x - ma) * (y - mb) for x, y in zip(da, db))
    va, vb = sum((x - ma) ** 2 for x in da), sum((y - mb) ** 2 for y in db)
    return cov / (va * vb) ** 0.5 if va > 0 and vb > 0 else None


def per_sample_relative_variance(spec: RunSpec, state_dict: dict, seed: int) -> dict:
    """``var / mean^2`` over the samples of one global batch of the per-sample KL term (the
    one-sample Monte Carlo estimate ``log q(z|x) - log p(z)``) and of the per-sample
    reconstruction error, at the weights ``state_dict`` (training mode, default noise)."""
    import pytorch_lightning as pl

    from vae_ddp.data import make_datamodule
    from vae_ddp.studies.report_scale import per_sample_terms
    from vae_ddp.harness.runner import build_model

    pl.seed_everything(seed, verbose=False)
    single = dataclasses.replace(spec, config="single", devices=1)
    model = build_model(single, seed)
    model.load_state_dict(state_dict)
    model = model.double() if spec.dtype == "float64" else model
    dm = make_datamodule(spec.data, spec.data_dir, batch_size=spec.global_batch_size, max_samples=spec.max_samples)
    dm.setup()
    x = next(iter(dm.train_dataloader()))[0].to(model.dtype)
    model.train()
    kl, rec = per_sample_terms(model, x)

    def rv(t):
        return float(t.var(unbiased=False) / t.mean() ** 2)

    return {"samples": len(x), "kl": rv(kl), "recon_loss": rv(rec), "kl_mean": float(kl.mean()),
            "recon_mean": float(rec.mean())}


def compare(base: RunSpec, configs: list[Literal[CONFIGS]], out_dir: Path, exact: bool = False) -> dict:
    """Train each configuration of ``configs`` from ``base`` (one seed: ``base.seeds[0]``).

    Every spec is validated before the first run starts. With ``exact`` every fix is on
    (for ``single`` and ``ddp``; ``dp`` stays Lightning 1.x DP).

    Args:
        base: settings shared by every configuration (steps, data, global batch size, ...).
        configs: the configurations to train, any of ``single``, ``ddp`` and ``dp``.
        out_dir: output folder.
        exact: turn every fix on for ``single`` and ``ddp`` (over the fix switches); ``dp`` stays
            Lightning 1.x DP.

    Returns the content written to ``out_dir/results.json``: ``settings``, ``records``
    (dicts with ``config``, ``label``, ``step`` and the global-batch ``recon_loss``,
    ``kl``, ``loss``, plus ``logged_*`` from rank 0 and ``val_*`` where validated).
    """
    out_dir = Path(out_dir)
    specs = []
    for c in configs:
        spec = dataclasses.replace(base, config=c, seeds=base.seeds[:1], label="", save_params=c == "single")
        # the fixes are for ddp and single; the dp emulation keeps Lightning 1.x DP's behaviour
        specs.append((spec.exact() if exact and c != "dp" else spec).validate())
    notes = []  # shown above the table on the page too
    for spec in specs:
        if spec.config == "dp":
            how = ("real torch.nn.DataParallel" if spec.dp_mode == "real"
                   else "single-process emulation of Lightning 1.x DP")
            notes.append(f"dp: {how} over {spec.devices} replicas")
            print(notes[-1], flush=True)
    records, series, rows, params = [], [], [], None
    for spec in specs:
        print(f"== {spec.label}: {spec.world_size} process(es), per-device batch {spec.per_device_batch_size}, "
              f"global batch {spec.global_batch_size}", flush=True)
    # one launch (single and dp share one process, ddp's ranks are forks beside it)
    for spec, (result, where) in zip(specs, launch_by_world_size(specs, out_dir / "runs")):
        run = result["runs"][0]
        if run.get("params"):
            params = where / run["params"]
        val_by_step = {v["step"]: v for v in run["val_records"]}
        for r in run["records"]:
            rec = {"config": spec.config, "label": spec.label, **r}
            if r["step"] in val_by_step:
                rec.update({f"val_{k}": v for k, v in val_by_step[r["step"]].items() if k != "step"})
            records.append(rec)
        series.append((spec.label, run["records"], run["val_records"]))
        last, lastval = run["records"][-1], (run["val_records"] or [{}])[-1]
        rows.append([spec.label, spec.world_size, spec.per_device_batch_size, last["loss"], last["kl"],
                     last["recon_loss"], lastval.get("kl"), lastval.get("recon_loss"),
                     lastval.get("recon_loss_batch_stats")])
    settings = dataclasses.asdict(base)  # devices: ddp's world size and dp's replicas
    settings.pop("config"), settings.pop("label")
    labels = [s.label for s in specs]
    spread = {lab: {m: spread_ratio([r for r in records if r["label"] == lab], m) for m in ("kl", "recon_loss")}
              for lab in labels}
    for lab in labels:
        own = [r for r in records if r["label"] == lab]
        spread[lab].update({f"relative_{m}": relative_spread(own, f"logged_{m}") for m in ("kl", "recon_loss")})
    co = {lab: {m: co_movement(records, lab, metric=m) for m in ("logged_kl", "logged_recon_loss")}
          for lab in labels if lab != "single"} if "single" in labels else {}
    relvar = None
    if params is not None:
        import torch

        relvar = per_sample_relative_variance(specs[0], torch.load(params)["state_dict"], base.seeds[0])
    result = {"settings": settings, "configs": labels, "records": records, "spread_ratio": spread,
              "co_movement": co, "relative_variance": relvar}
    title = f"{base.model} VAE on {base.data}, global batch {base.global_batch_size}, {base.steps} steps"
    tables = "\n\n".join([*notes, render(result, rows)])
    write_results(out_dir, result, series, tables, title)
    print(tables)
    print(f"wrote {out_dir / 'results.json'}, {out_dir / 'curves.png'}, {out_dir / 'report_style.png'} and "
          f"{out_dir / 'tables.md'}")
    return result


def write_results(out_dir: Path, result: dict, series: list, tables: str, title: str) -> None:
    """``results.json``, ``curves.png``, ``report_style.png`` and ``tables.md`` into ``out_dir``,
    replacing the ones there as one set ([`result_set`][vae_ddp.outputs.result_set]).

    Raises:
        vae_ddp.outputs.OutOfSpace: the file system is full (the old set stays).
    """
    from vae_ddp.outputs import result_set

    with result_set(out_dir) as new:
        (new / "results.json").write_text(json.dumps(result, indent=1))
        plot_curves(series, new / "curves.png", title)
        plot_report_style(result["records"], result["configs"], new / "report_style.png", title)
        write_tables(new, tables)


def render(result: dict, rows: list[list]) -> str:
    """The Markdown tables of a comparison (``rows``: the last step of each configuration)."""
    steps = result["settings"]["steps"]
    out = [format_table(["config", "processes", "per-device batch", "train loss", "train kl", "train recon"],
                        [r[:6] for r in rows], title=f"Training, after {steps} steps"),
           format_table(["config", "val kl", "val recon", "val recon, BatchNorm batch statistics"],
                        [[r[0], *r[6:]] for r in rows], title=f"Validation, after {steps} steps")]
    spread = result["spread_ratio"]
    out.append(format_table(
        ["config", "KL: logged spread / global-batch spread", "reconstruction: logged / global-batch",
         "KL: logged spread / mean", "reconstruction: logged spread / mean"],
        [[lab, spread[lab]["kl"], spread[lab]["recon_loss"], spread[lab].get("relative_kl"),
          spread[lab].get("relative_recon_loss")] for lab in result["configs"]],
        title="Step-to-step spread of the logged training curve: over that of the whole global batch, "
              "and relative to its own level"))
    co = result.get("co_movement") or {}
    if co:
        out.append(format_table(
            ["config", "KL as logged", "reconstruction as logged"],
            [[lab, c["logged_kl"], c["logged_recon_loss"]] for lab, c in co.items()],
            title="Do the logged curves wiggle with single's? Correlation of step-to-step changes with single"))
    rv = result.get("relative_variance")
    if rv:
        out.append(format_table(
            ["term", "per-sample variance / mean^2", "batch mean"],
            [["KL (one-sample Monte Carlo estimate)", rv["kl"], rv["kl_mean"]],
             ["reconstruction (MSE)", rv["recon_loss"], rv["recon_mean"]]],
            title=f"Per-sample relative variance on one global batch of {rv['samples']} at single's final weights"))
    return "\n\n".join(out)
