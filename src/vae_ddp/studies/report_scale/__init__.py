"""The report's scale: how large is each factor's effect on one step, next to batch noise?

At the report's scale (ResNet-18 VAE, global batch 256, DDP on 2 ranks x 128) a long run
is out of reach on a CPU, but what one optimizer step does is not. This study trains
nothing: every run keeps its weights frozen at the initial ones (the all-reduced gradient
is recorded in ``on_before_optimizer_step`` and then zeroed, so Adam's step is exactly
0), and Lightning runs ``grad_steps`` steps on consecutive global batches. For each
variant it measures, at step k,

- ``||g_variant,k - g_single,k||``: how far its gradient is from one device's on the
  same global batch k (the reference ``single`` run draws its batches with a one-replica
  [`GlobalBatchDistributedSampler`][vae_ddp.fixes.sampler.GlobalBatchDistributedSampler],
  whose batch k is the union of the ranks' batches k under Lightning's
  ``DistributedSampler`` with the same seed, and its noise with
  [`GlobalBatchNoise`][vae_ddp.fixes.noise.GlobalBatchNoise]);

and divides it by the batch-to-batch gradient noise of ``single``: the mean of
``||g_single,k - g_single,k'||`` over pairs of different batches of 256. A ratio of 1 means
"as different as another batch would be".

Variants (each factor alone, by turning every fix on except that one, as the ablation
does): ``ddp`` with Lightning's defaults; ``ddp`` with every fix (the rounding floor);
noise back to the default (the same stream on both ranks); BatchNorm back to per-rank;
sampler back to Lightning's ``DistributedSampler``; and the emulation of Lightning 1.x
DP (see [`vae_ddp.dp`][vae_ddp.dp]).

Logging changes no gradient. Its effect on what the report plotted is measured on the
default ``ddp`` run, with the same yardstick: ``|logged KL - global-batch KL|`` per step
(Lightning logs rank 0's mean of 128 samples) over the mean difference between the
global-batch KL of two different batches; plus the spread ratio
``std(logged KL) / std(global-batch KL)`` over batches at the frozen weights, and the
per-sample relative variance ``var / mean^2`` of the one-sample Monte Carlo KL estimate
and of the reconstruction (MSE) term, from ``spread_batches`` extra forward passes.

The runs of one world size train in a child of [`launch`][vae_ddp.harness.launch.launch] as
``runs.frozen_runs`` (its ``train``); the study
itself is [`report_scale`][vae_ddp.studies.report_scale.report_scale], here with its comparison
and writing. The package's other modules, whose public names this one re-exports: ``variants``
(``VARIANTS``, ``FACTOR_VARIANTS``, the quantities, ``ranking`` and ``factor_effects``), ``runs``
(the child's frozen-weights runs, ``per_sample_terms``), ``render`` (an effect's words, the
Markdown tables) and ``plot`` (the figure).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
from pathlib import Path
from typing import Any, Literal

import torch

from vae_ddp.data import DATASETS
from vae_ddp.harness.configs import RunSpec
from vae_ddp.model import MODELS
from vae_ddp.outputs import result_set
from vae_ddp.studies.report_scale.plot import plot
from vae_ddp.studies.report_scale.render import CELL, effect_cell, effect_line, logging_cell, render
from vae_ddp.studies.report_scale.runs import per_sample_terms
from vae_ddp.studies.report_scale.variants import (DEFAULT_VARIANT, FACTOR_VARIANTS, FLOOR_RATIO, QUANTITIES,
                                                   VARIANTS, factor_effects, ranking)

__all__ = ["VARIANTS", "FACTOR_VARIANTS", "command_md", "effect_cell", "effect_line", "factor_effects", "logging_cell",
           "logging_effect", "plot", "ranking", "reread", "render", "report_scale", "rows_of",
           "CELL", "per_sample_terms"]  # the last two: what answer.py, compare.py and examples/ import from here

#: The parameter groups of the gradient differences.
GROUPS = ("all", "encoder", "fc_mu/fc_var", "decoder")
#: Gradients are decomposed through their CountSketch of this length (the audit's).
SKETCH = 4096


def _group(name: str) -> str:
    return "fc_mu/fc_var" if name.startswith(("fc_mu", "fc_var")) else name.split(".")[0]


def _norms(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
    """L2 norm of ``a - b`` (or of ``a``) per parameter group and over all parameters."""
    sq = dict.fromkeys(GROUPS, 0.0)
    for n, t in a.items():
        d = t if b is None else t - b[n]
        s = float(d.double().pow(2).sum())
        sq[_group(n)] = sq.get(_group(n), 0.0) + s
        sq["all"] += s
    return {g: math.sqrt(sq[g]) for g in GROUPS}


def _mean_dicts(ds: list[dict[str, float]]) -> dict[str, float]:
    return {g: statistics.fmean(d[g] for d in ds) for g in GROUPS}


def _std(v: list[float]) -> float:
    return statistics.stdev(v) if len(v) > 1 else float("nan")


def _relvar(values: list[float]) -> float:
    m = statistics.fmean(values)
    return statistics.pvariance(values) / (m * m)


def report_scale(
    out_dir: Path = Path("runs/report-scale"),
    data: Literal[DATASETS] = "imagefolder",
    data_dir: str | None = None,
    model: Literal[MODELS] = "resnet18",
    global_batch_size: int = 256,
    devices: int = 2,
    grad_steps: int = 3,
    spread_batches: int = 6,
    effect_batches: int = 0,
    variants: list[Literal[tuple(VARIANTS)]] | None = None,
    max_samples: int | None = None,
    seed: int = 0,
    accelerator: Literal["cpu", "gpu"] = "cpu",
) -> dict:
    """Measure each factor's per-step gradient difference at the report's scale.

    Args:
        out_dir: output folder (``--out``): ``report_scale.json``, ``tables.md`` (the Markdown tables it
            prints), ``report_scale.png``; each run's files under ``runs/``.
        data: ``imagefolder`` (e.g. the CIFAR-10 subset built by
            ``.github/scripts/cifar10-subset.sh``), ``cifar10`` (full CIFAR-10 via
            torchvision, downloaded into ``data_dir``) or ``digits``.
        data_dir: ImageFolder root (required with ``imagefolder``: there is no default folder)
            or CIFAR-10 folder (``cifar10``); unused with ``digits``.
        model: ``resnet18`` (the report's, 20,057,088 parameters) or ``small``.
        global_batch_size: samples per optimizer step (the report's: 256).
        devices: DDP world size and DP replicas (the report's: 2).
        grad_steps: optimizer steps, i.e. consecutive global batches, per run (>= 2: the
            batch-to-batch noise needs two batches).
        spread_batches: further forward passes of the default ``ddp`` run for the
            logged-KL spread and the per-sample variances (0: skip).
        effect_batches: global batches (frozen-weights steps, >= 4; 0: skip) from which each
            variant's effect is decomposed into a bias and a noise ratio
            ([`vae_ddp.harness.effect`][vae_ddp.harness.effect]) on the gradient, the KL and the
            reconstruction; the runs take ``max(grad_steps, effect_batches)`` steps.
        variants: names from [`VARIANTS`][vae_ddp.studies.report_scale.variants.VARIANTS] (default: all).
        max_samples: use a fixed random subset of this many images (None: all).
        seed: ``seed_everything`` seed of every run (the same initial weights for all).
        accelerator: ``cpu`` (gloo) or ``gpu``.

    Returns:
        The content of ``report_scale.json``: ``settings``, ``batch_noise`` (per parameter
        group), ``grad_norm``, ``variants`` (per variant: ``diff`` and
        ``ratio_to_batch_noise`` per group, per step too), ``logging``, ``spread``,
        ``reduction`` and ``ranking``.

    Raises:
        UserError: bad settings (before any run starts), ``data="imagefolder"`` without a
            ``data_dir`` included.
    """
    names = _check(variants, grad_steps, spread_batches, effect_batches)
    out = Path(out_dir)
    steps = max(grad_steps, effect_batches)
    base = RunSpec(data=data, data_dir=data_dir, model=model, global_batch_size=global_batch_size, devices=devices,
                   steps=steps, seeds=[seed], max_samples=max_samples, accelerator=accelerator,
                   record_indices=True).exact()
    ref_spec = dataclasses.replace(base, config="single", label="single").validate()
    specs = {n: dataclasses.replace(base, config=VARIANTS[n][0], label=n, **VARIANTS[n][1]).validate() for n in names}
    n_train = _enough_images(ref_spec, steps, spread_batches)
    runs = _run_all([(ref_spec, "single", 0)]
                    + [(specs[name], f"variant{i}", spread_batches if name == DEFAULT_VARIANT else 0)
                       for i, name in enumerate(names)], out,
                   keep=grad_steps, sketch=SKETCH if effect_batches else 0)
    result = _compare(runs, specs, names)
    result["settings"] = {**dataclasses.asdict(ref_spec), "grad_steps": grad_steps, "spread_batches": spread_batches,
                          "effect_batches": effect_batches,
                          "train_samples": n_train, "world_size": devices, "variants": names}
    sketches = result.pop("_sketches", None)
    result = {key: result[key] for key in ("settings", "grad_norm", "batch_noise", "variants", "logging", "spread",
                                           "rows")}
    result["reduction"] = _reduction(n_train, global_batch_size, devices)
    result["ranking"] = ranking(result)
    _write(result, out, sketches)
    return result


def _enough_images(spec: RunSpec, steps: int, spread_batches: int) -> int:
    """The training set's size; ``UserError`` when one epoch holds fewer than ``steps + spread_batches``
    global batches."""
    n_train = _train_size(spec)
    if n_train < (steps + spread_batches) * spec.global_batch_size:
        from vae_ddp.errors import UserError

        raise UserError(f"{n_train} training images are too few for {steps} steps and {spread_batches} spread batches "
                        f"of {spec.global_batch_size} in one epoch: lower --grad_steps, --effect_batches or "
                        "--spread_batches, or use more data")
    return n_train


def _check(variants: list[str] | None, grad_steps: int, spread_batches: int, effect_batches: int = 0) -> list[str]:
    """The variants' names (default: all); bad settings raise ``UserError`` before any run."""
    from vae_ddp.errors import UserError

    names = list(VARIANTS) if variants is None else list(variants)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise UserError(f"unknown variant {unknown[0]!r}: use any of {', '.join(repr(v) for v in VARIANTS)}")
    if grad_steps < 2:
        raise UserError(f"--grad_steps must be at least 2 (batch-to-batch noise needs two batches), got {grad_steps}")
    if spread_batches < 0:
        raise UserError(f"--spread_batches must be 0 or more, got {spread_batches}")
    if effect_batches and effect_batches < 4:
        raise UserError(f"--effect_batches must be 0 (skip) or at least 4, got {effect_batches}")
    return names


def _run_all(jobs: list[tuple[RunSpec, str, int]], out: Path, keep: int, sketch: int) -> dict[str, tuple[dict, dict]]:
    """Train ``(spec, folder, spread_batches)`` jobs, a group per world size, all in one launch
    on CPU ([`launch_by_world_size`][vae_ddp.harness.launch.launch_by_world_size] with this
    module's child); {folder: ({"grads": the first ``keep`` steps' gradients, "sketches": every
    step's ``sketch``-long sketch}, info)}."""
    from vae_ddp.harness.launch import group_folder, launch_by_world_size

    by_folder: dict[Path, list] = {}
    for spec, folder, spread in jobs:
        group = out / "runs" / group_folder(spec.world_size, spec.accelerator)
        by_folder.setdefault(group, []).append((folder, spread))
        print(f"== {spec.label}: {spec.world_size} process(es) x per-device batch {spec.per_device_batch_size}",
              flush=True)
    for d, group in by_folder.items():  # what each group's runs keep, beside the specs
        d.mkdir(parents=True, exist_ok=True)
        (d / "worker.json").write_text(json.dumps([{"folder": str(d / folder), "spread_batches": spread,
                                                    "keep": keep, "sketch": sketch} for folder, spread in group]))
    found = {}
    launched = launch_by_world_size([spec for spec, _, _ in jobs], out / "runs",
                                    train="vae_ddp.studies.report_scale.runs:frozen_runs")
    for (_, folder, _), (_, d) in zip(jobs, launched):
        grads = torch.load(d / folder / "grads.pt")  # {"grads": [...], "sketches": [...]}
        (d / folder / "grads.pt").unlink()  # ~80 MB per step for ResNet-18: keep only the numbers
        found[folder] = (grads, json.loads((d / folder / "run.json").read_text()))
    return found


def _compare(runs: dict[str, tuple[list, dict]], specs: dict[str, RunSpec], names: list[str]) -> dict[str, Any]:
    """Each variant's per-step gradient difference to the one-device run, and its ratio to the
    batch-to-batch noise (``grad_norm``, ``batch_noise``, ``variants``, ``logging``, ``spread``)."""
    ref = runs["single"][0]["grads"]
    pairs = list(itertools.combinations(range(len(ref)), 2))
    noise = _mean_dicts([_norms(ref[i], ref[j]) for i, j in pairs])
    result: dict[str, Any] = {"grad_norm": _mean_dicts([_norms(g) for g in ref]),
                              "batch_noise": noise, "variants": {}, "logging": None, "spread": None}
    for i, name in enumerate(names):
        spec = specs[name]
        saved, info = runs[f"variant{i}"]
        grads = saved["grads"]
        per_step = [_norms(g, r) for g, r in zip(grads, ref)]
        diff = _mean_dicts(per_step)
        result["variants"][name] = {
            "config": spec.config, "factor": VARIANTS[name][2], "fixes": spec.fixes(), "diff": diff,
            "batches_as_single": _same_batches(runs["single"][1], info),
            "ratio_to_batch_noise": {g: diff[g] / noise[g] for g in GROUPS},
            "ratio_per_step": [d["all"] / noise["all"] for d in per_step],
        }
        if name == DEFAULT_VARIANT:
            result["logging"], result["spread"] = _logging(info)
    result["rows"] = _scalar_rows(runs, names)
    if runs["single"][0]["sketches"]:
        result["_sketches"] = {name: torch.stack(list(runs[folder][0]["sketches"])).double().numpy()
                               for name, folder in {"single": "single",
                                                    **{n: f"variant{i}" for i, n in enumerate(names)}}.items()}
        effects = _effects(runs, names)
        for i, name in enumerate(names):
            result["variants"][name]["effect"] = effects[name]
        if result["logging"]:
            result["logging"]["effect"] = logging_effect(result["logging"])
    return result




def _same_batches(single: dict, info: dict) -> list[int]:
    """``[k, n]``: in how many of the ``n`` steps this run's global batch holds the same dataset indices
    as one device's (as multisets; order aside): what pairs a variant's row with one device's."""
    a = [sorted(r.get("indices") or []) for r in single["records"]]
    b = [sorted(r.get("indices") or []) for r in info["records"]]
    return [sum(1 for u, v in zip(a, b) if u and u == v), min(len(a), len(b))]


def _scalar_rows(runs: dict[str, tuple[dict, dict]], names: list[str]) -> dict[str, dict[str, list[float]]]:
    """Every run's per-step global-batch KL and reconstruction (``{"single" or variant: {"kl": [...],
    "reconstruction": [...]}}``): the rows the effects are decomposed from, kept with the result so that
    an estimate can be read again from them."""
    labels = {"single": "single", **{name: f"variant{i}" for i, name in enumerate(names)}}
    out = {}
    for name, folder in labels.items():
        q = _quantities(*runs[folder])
        out[name] = {"kl": q["kl"], "reconstruction": q["reconstruction"]}
    return out


def _quantities(saved: dict, info: dict) -> dict[str, list]:
    """One run's rows per quantity: each step's gradient sketch (rounded to float32, as
    ``gradient_rows.npz`` keeps them, in the coordinates of their span), the global batch's KL and reconstruction."""
    recs = info["records"]
    return {"gradient": [t.float().double().numpy() for t in saved["sketches"]], "kl": [r["kl"] for r in recs],
            "reconstruction": [r["recon_loss"] for r in recs]}


def _effects(runs: dict[str, tuple[dict, dict]], names: list[str]) -> dict[str, dict]:
    """Each variant's effects (``_decompose_all``) from the runs' rows."""
    return _decompose_all(_quantities(*runs["single"]),
                          {name: _quantities(*runs[f"variant{i}"]) for i, name in enumerate(names)})


def _decompose_all(x: dict[str, list], ys: dict[str, dict[str, list]]) -> dict[str, dict]:
    """Each variant's [`decompose`][vae_ddp.harness.effect.decompose] against ``single`` per quantity
    (``{"gradient": effect, "kl": ..., "reconstruction": ...}`` with ``"kind"``, the most serious of
    the three): the rows (``x``: one device's, ``ys``: each variant's, per quantity) are the frozen
    runs' steps, one global batch each, all from the initial weights (one group). The floor:
    ``FLOOR_RATIO`` times the largest relative difference of ``ddp, every fix`` where it ran (0 where
    it did not: only the same bits are ``exact``)."""
    from vae_ddp.harness import effect as stats

    floor = dict.fromkeys(QUANTITIES, 0.0)
    if "ddp, every fix" in ys:
        floor = {q: FLOOR_RATIO * stats.decompose(x[q], ys["ddp, every fix"][q])["largest_row"] for q in QUANTITIES}
    out = {}
    for name, y in ys.items():
        parts = {q: stats.decompose(x[q], y[q], floor=floor[q]) for q in QUANTITIES}
        out[name] = dict(parts, kind=min((p["kind"] for p in parts.values()), key=stats.KINDS.index), floor=floor)
    return out


def rows_of(result: dict, folder: Path) -> tuple[dict[str, list], dict[str, dict[str, list]]]:
    """The rows a committed result was decomposed from: ``(one device's, {variant: its})``, per quantity,
    from ``report_scale.json``'s ``rows`` and ``folder``'s ``gradient_rows.npz``."""
    import numpy as np

    with np.load(Path(folder) / "gradient_rows.npz") as z:
        sketches = {name: z[name.replace(" ", "_")].astype(np.float64) for name in result["rows"]}

    def of(name: str) -> dict[str, list]:
        return {"gradient": list(sketches[name]), **result["rows"][name]}

    return of("single"), {name: of(name) for name in result["settings"]["variants"]}


def reread(out_dir: Path) -> dict:
    """Decompose a study's effects again from the rows it kept (``report_scale.json``'s ``rows``,
    ``gradient_rows.npz``), with this version's estimator, and write the folder anew (its JSON,
    tables, command and figure): what a change of [`vae_ddp.harness.effect`][vae_ddp.harness.effect]
    needs instead of training again. Returns the new ``report_scale.json`` content.

    Raises:
        FileNotFoundError: ``out_dir`` holds no ``report_scale.json`` or ``gradient_rows.npz``.
        KeyError: a result written before the study kept its rows."""
    import numpy as np

    out = Path(out_dir)
    result = json.loads((out / "report_scale.json").read_text())
    x, ys = rows_of(result, out)
    effects = _decompose_all(x, ys)
    for name, effect in effects.items():
        result["variants"][name]["effect"] = effect
    if result.get("logging"):
        result["logging"]["effect"] = logging_effect(result["logging"])
    result["ranking"] = ranking(result)
    sketches = {name: np.asarray(rows["gradient"]) for name, rows in {"single": x, **ys}.items()}
    _write(result, out, sketches)
    return result


def logging_effect(logging: dict) -> dict[str, dict]:
    """What logging rank 0's mean does to the plotted value: [`decompose`][vae_ddp.harness.effect.decompose]
    of the logged KL and reconstruction (rank 0's half batch) against the global batch's, step by step
    (``{"kl": effect, "reconstruction": effect}``): a bias would shift the curve, a noise ratio above 1
    makes it noisier."""
    from vae_ddp.harness import effect as stats

    return {"kl": stats.decompose(logging["global_kl"], logging["logged_kl"]),
            "reconstruction": stats.decompose(logging["global_recon"], logging["logged_recon"])}


def _write(result: dict, out: Path, sketches: dict | None = None) -> None:
    """``report_scale.json``, ``tables.md``, ``command.md`` and ``report_scale.png`` in ``out``, and with
    ``sketches`` (``{"single" or variant: (steps, SKETCH) array}``) ``gradient_rows.npz``: the gradient rows
    the effects were decomposed from; the tables printed."""
    import numpy as np

    from vae_ddp.harness.table import write_tables

    tables = render(result)
    with result_set(out) as new:
        (new / "report_scale.json").write_text(json.dumps(result, indent=1))
        if sketches:
            np.savez_compressed(new / "gradient_rows.npz", **_same_inner_products(sketches))
        write_tables(new, tables)
        (new / "command.md").write_text(command_md(result, out))
        plot(result, new / "report_scale.png")
    print(tables)
    print(f"wrote {out / 'report_scale.json'}, {out / 'tables.md'}, {out / 'command.md'} "
          f"and {out / 'report_scale.png'}")


def _same_inner_products(rows: dict[str, Any]) -> dict[str, Any]:
    """Every run's gradient rows (``(steps, SKETCH)`` each) in the coordinates of the space they span
    (``(steps, k)``, ``k`` the number of rows in all, float64): the same inner products, norms and
    differences, so every statistic of [`decompose`][vae_ddp.harness.effect.decompose], which reads rows
    only through them, is unchanged, in a tenth of the bytes. Keyed by name, spaces as underscores."""
    import numpy as np

    names = list(rows)
    stacked = np.concatenate([np.asarray(rows[n], dtype=np.float64) for n in names])
    r = np.linalg.qr(stacked.T, mode="r")  # stacked = (Q r)^T: rows of r^T keep every inner product
    coords = r.T
    out, at = {}, 0
    for n in names:
        out[n.replace(" ", "_")] = coords[at:at + len(rows[n])]
        at += len(rows[n])
    return out


def command_md(result: dict, out: Path) -> str:
    """The ``vae-ddp report-scale`` command that reproduces ``result`` (a Markdown code block)."""
    import shlex

    s = result["settings"]
    words = ["vae-ddp", "report-scale", "--data", s["data"]]
    note = ""
    if s.get("data_dir"):  # the folder as a reader names it, not this machine's path
        words += ["--data_dir", "DIR"]
        note = ("# DIR: the CIFAR-10 subset that .github/scripts/cifar10-subset.sh builds (ImageFolder tree)\n"
                if s["data"] == "imagefolder" else "# DIR: where torchvision keeps CIFAR-10\n")
    words += ["--model", s["model"], "--global_batch_size", str(s["global_batch_size"]), "--devices",
              str(s["world_size"]), "--grad_steps", str(s["grad_steps"]), "--spread_batches", str(s["spread_batches"])]
    if s.get("effect_batches"):
        words += ["--effect_batches", str(s["effect_batches"])]
    if s.get("max_samples"):
        words += ["--max_samples", str(s["max_samples"])]
    if s["variants"] != list(VARIANTS):
        words += ["--variants", json.dumps(s["variants"])]
    words += ["--seed", str(s["seeds"][0]), "--out", str(out)]
    return "```bash\n" + note + shlex.join(words) + "\n```\n"


def _train_size(spec: RunSpec) -> int:
    from vae_ddp.data import make_datamodule

    dm = make_datamodule(spec.data, spec.data_dir, batch_size=spec.per_device_batch_size, max_samples=spec.max_samples)
    dm.setup()
    return len(dm.dataset_train)


def _logging(info: dict) -> tuple[dict, dict | None]:
    """Logging's per-step effect (training steps and spread passes of the default ddp run)."""
    recs, sp = info["records"], info.get("spread")
    logged = [r["logged_kl"] for r in recs] + (sp["rank0_kl"] if sp else [])
    glob = [r["kl"] for r in recs] + (sp["global_kl"] if sp else [])
    logged_r = [r["logged_recon_loss"] for r in recs] + (sp["rank0_recon"] if sp else [])
    glob_r = [r["recon_loss"] for r in recs] + (sp["global_recon"] if sp else [])

    def ratio(a: list[float], b: list[float]) -> float:
        dev = statistics.fmean(abs(x - y) for x, y in zip(a, b))
        between = statistics.fmean(abs(b[i] - b[j]) for i, j in itertools.combinations(range(len(b)), 2))
        return dev / between

    logging = {"batches": len(logged), "kl_ratio": ratio(logged, glob), "recon_ratio": ratio(logged_r, glob_r),
               "logged_kl": logged, "global_kl": glob, "logged_recon": logged_r, "global_recon": glob_r}
    spread = None
    if len(logged) > 2:
        spread = {"batches": len(logged),
                  "kl_std_logged": _std(logged), "kl_std_global": _std(glob),
                  "kl_spread_ratio": _std(logged) / _std(glob),
                  "recon_std_logged": _std(logged_r), "recon_std_global": _std(glob_r),
                  "recon_spread_ratio": _std(logged_r) / _std(glob_r)}
        if sp:
            kl = [v for b in sp["sample_kl"] for v in b]
            rec = [v for b in sp["sample_recon"] for v in b]
            spread.update({"samples": len(kl), "relvar_kl": _relvar(kl), "relvar_recon": _relvar(rec)})
    return logging, spread


def _reduction(n_train: int, global_batch: int, world: int) -> dict:
    """Mean reduction at this scale: with ``DistributedSampler`` every rank gets
    ``ceil(n / N)`` samples (padded by repetition), so per-rank batches are equal at
    every step, the epoch's last included; only padded repeats weigh unequally."""
    per_rank = math.ceil(n_train / world)
    last = per_rank % (global_batch // world) or global_batch // world
    return {"train_samples": n_train, "padded_samples": per_rank * world - n_train,
            "per_rank_last_batch": last, "single_last_batch": n_train % global_batch or global_batch,
            "unequal_steps_per_epoch": 1 if per_rank * world != n_train else 0}
