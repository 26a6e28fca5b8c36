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

``python -m vae_ddp.studies.report_scale SPECS_JSON OUT_DIR`` is the child-process entry of
the runs of one world size (started by [`launch`][vae_ddp.harness.launch.launch]); the study itself is
[`report_scale`][vae_ddp.studies.report_scale.report_scale].
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Literal

import torch

from vae_ddp.data import DATASETS
from vae_ddp.harness.configs import RunSpec
from vae_ddp.harness.permutation import FLOOR_FACTOR
from vae_ddp.model import MODELS
from vae_ddp.outputs import replacing, result_set, write_atomic

__all__ = ["VARIANTS", "FACTOR_VARIANTS", "command_md", "effect_cell", "effect_line", "factor_effects", "logging_cell",
           "logging_effect", "plot", "ranking", "render", "report_scale"]

#: name -> (configuration, fields changed from the exact spec, factor it isolates).
VARIANTS: dict[str, tuple[str, dict, str]] = {
    "ddp, Lightning defaults": ("ddp", {"noise": "default", "sync_bn": False, "sampler": "default",
                                        "sync_dist_logging": False}, "all factors together"),
    "ddp, noise back to default": ("ddp", {"noise": "default"}, "Random streams per rank"),
    "ddp, BatchNorm back to per-rank": ("ddp", {"sync_bn": False}, "BatchNorm statistics"),
    "ddp, sampler back to DistributedSampler": ("ddp", {"sampler": "default"}, "Sampler and data order"),
    "dp (emulation of Lightning 1.x DP)": ("dp", {"noise": "default", "sync_bn": False, "sampler": "global",
                                                  "sync_dist_logging": False}, "DP's chunks"),
    "ddp, every fix": ("ddp", {}, "none (rounding floor)"),
}
DEFAULT_VARIANT = "ddp, Lightning defaults"
#: factor key of ``vae_ddp.fixes.registry`` -> the variant that isolates it (every fix on but that one);
#: the factor names in ``VARIANTS`` are the registry's (tests/test_names.py checks)
FACTOR_VARIANTS = {"noise": "ddp, noise back to default", "batchnorm": "ddp, BatchNorm back to per-rank",
                   "sampler": "ddp, sampler back to DistributedSampler"}
GROUPS = ("all", "encoder", "fc_mu/fc_var", "decoder")
#: Gradients are decomposed through their CountSketch of this length (the audit's).
SKETCH = 4096


def _group(name: str) -> str:
    return "fc_mu/fc_var" if name.startswith(("fc_mu", "fc_var")) else name.split(".")[0]


# --------------------------------------------------------------------------- the child process
class _FrozenGradients:
    """Lightning callback (built lazily to keep this module light): keep the gradient Adam
    receives at every step (after DDP's all-reduce), then zero it, so the weights never move.
    The first ``keep`` steps' gradients are kept whole (``grads``), every step's as its
    ``sketch``-long [`count_sketch`][vae_ddp.probes.count_sketch] (``sketches``: the same linear
    map in every run, so norms and traces of differences are kept in expectation)."""

    def __new__(cls, keep: int, sketch: int = 0):
        from pytorch_lightning import Callback

        from vae_ddp.probes import count_sketch

        class FrozenGradients(Callback):
            def __init__(self) -> None:
                self.grads: list[dict[str, torch.Tensor]] = []
                self.sketches: list[torch.Tensor] = []

            def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
                named = sorted((n, p) for n, p in pl_module.named_parameters() if p.grad is not None)
                if len(self.grads) < keep:
                    self.grads.append({n: p.grad.detach().float().cpu().clone() for n, p in named})
                if sketch:
                    flat = torch.cat([p.grad.detach().reshape(-1).double().cpu() for _, p in named])
                    self.sketches.append(count_sketch(flat, sketch))
                for _, p in named:
                    p.grad.zero_()  # Adam: m = v = 0, update lr * 0 / (0 + eps) = 0

        return FrozenGradients()


def per_sample_terms(module, x: torch.Tensor, eps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample ``(kl, recon)``, each ``(B,)``, of one training-mode forward of ``x: (B, 3, H, W)``.

    The forward runs once on the whole batch (BatchNorm sees the batch, as in training);
    each sample's terms are then [`vae_loss`][vae_ddp.model.vae_loss] of that row alone, so
    their mean is the batch's ``kl`` and ``recon_loss`` (equal numbers of elements per row).
    """
    from vae_ddp.model import vae_loss

    with torch.no_grad():
        h = module.encoder(x)
        mu, log_var = module.fc_mu(h), module.fc_var(h)
        p, q, z = module.sample(mu, log_var, eps)
        x_hat = module.decoder(z)
        kl, rec = [], []
        for i in range(len(x)):
            pi = torch.distributions.Normal(p.loc[i:i + 1], p.scale[i:i + 1])
            qi = torch.distributions.Normal(q.loc[i:i + 1], q.scale[i:i + 1])
            _, logs = vae_loss(x[i:i + 1], x_hat[i:i + 1], pi, qi, z[i:i + 1], module.kl_coeff, module.kl_estimator)
            kl.append(logs["kl"])
            rec.append(logs["recon_loss"])
    return torch.stack(kl).double(), torch.stack(rec).double()


def _spread(trainer, module, skip: int, batches: int) -> dict:
    """``batches`` further training-mode forward passes at the frozen weights on this rank's
    batches (after the first ``skip``): rank 0's mean, the global mean and every sample's terms."""
    loader = trainer.train_dataloader
    module.train()
    out: dict[str, list] = {"rank0_kl": [], "global_kl": [], "rank0_recon": [], "global_recon": [],
                            "sample_kl": [], "sample_recon": []}
    for i, batch in enumerate(loader):
        if i < skip:
            continue
        if i >= skip + batches:
            break
        x = batch[0].to(module.device, module.dtype)
        kl, rec = per_sample_terms(module, x)
        stats = torch.stack([kl.sum(), rec.sum(), torch.tensor(float(len(x)), dtype=torch.float64)])
        tot = trainer.strategy.reduce(stats.clone(), reduce_op="sum")
        every_kl = trainer.strategy.all_gather(kl).reshape(-1)
        every_rec = trainer.strategy.all_gather(rec).reshape(-1)
        out["rank0_kl"].append(float(kl.mean()))  # what self.log(on_step=True) shows under DDP
        out["rank0_recon"].append(float(rec.mean()))
        out["global_kl"].append(float(tot[0] / tot[2]))
        out["global_recon"].append(float(tot[1] / tot[2]))
        out["sample_kl"].append(every_kl.tolist())
        out["sample_recon"].append(every_rec.tolist())
    return out


def _frozen_runs(specs: list[RunSpec], out: Path) -> int:
    """Frozen-weights runs of one world size, one after the other in this rank (the child of a
    launch, [`run_job`][vae_ddp.harness.launch.run_job]): ``OUT_DIR/worker.json`` lists, per
    spec, its ``folder`` and ``spread_batches``; rank 0 writes ``grads.pt`` and ``run.json``
    into each folder, and ``OUT_DIR/run.json``."""
    import pytorch_lightning as pl

    from vae_ddp.data import make_datamodule
    from vae_ddp.recording import GlobalBatchRecorder
    from vae_ddp.harness.runner import build_model, build_trainer, close_process_group
    from vae_ddp.utils import quiet

    jobs = json.loads((out / "worker.json").read_text())
    quiet()
    is_zero = False
    for spec, job in zip(specs, jobs):
        seed = spec.seeds[0]
        pl.seed_everything(seed, verbose=False)
        dm = make_datamodule(spec.data, spec.data_dir, global_batch_size=spec.global_batch_size,
                             max_samples=spec.max_samples, sampler=spec.sampler, sampler_seed=seed)
        model = build_model(spec, seed)
        recorder = GlobalBatchRecorder(spec.steps, 0, spec.label, progress=True)
        frozen = _FrozenGradients(job.get("keep", spec.steps), job.get("sketch", 0))
        trainer = build_trainer(spec, seed, [recorder, frozen])
        trainer.fit(model, datamodule=dm)
        spread = _spread(trainer, model, spec.steps, job["spread_batches"]) if job["spread_batches"] else None
        is_zero = trainer.is_global_zero
        if is_zero:
            folder = Path(job["folder"])
            folder.mkdir(parents=True, exist_ok=True)
            with replacing(folder / "grads.pt") as tmp:
                torch.save({"grads": frozen.grads, "sketches": frozen.sketches}, tmp)
            write_atomic(folder / "run.json", json.dumps({"records": recorder.records, "spread": spread}))
    if is_zero:
        write_atomic(out / "run.json", json.dumps({"group": [{"folder": job["folder"]} for job in jobs]}))
    close_process_group()
    return 0


# --------------------------------------------------------------------------- the study
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


def ranking(result: dict) -> list[dict]:
    """The training factors by what they change in what DDP trains, most serious first: each
    variant's effect (``different`` before ``inconclusive``, ``same distribution`` and ``exact``,
    [`KINDS`][vae_ddp.harness.effect.KINDS]' order; then the larger bias, then the noise ratio
    further from 1), on the gradient. Logging changes what is plotted, not what is trained: it is
    not ranked with these. Empty where the study measured no effects (``--effect_batches 0``)."""
    from vae_ddp.harness import effect as stats

    rows = [{"factor": VARIANTS[name][2] if name in VARIANTS else v["factor"], "variant": name,
             "kind": v["effect"]["kind"], "bias": v["effect"]["gradient"]["bias"],
             "variance_ratio": v["effect"]["gradient"]["variance_ratio"]}
            for name, v in result["variants"].items()
            if v.get("effect") and name not in (DEFAULT_VARIANT, "ddp, every fix")]
    return sorted(rows, key=lambda r: (stats.KINDS.index(r["kind"]), -r["bias"],
                                       -abs(math.log(r["variance_ratio"])) if r["variance_ratio"] > 0 else 0.0))


def factor_effects(result: dict) -> dict[str, dict]:
    """``{factor key: effect}``: each training factor's effect at the report's scale (the variant
    that isolates it, every other fix on; ``{"kind", "gradient", "kl", "reconstruction"}``, each part
    a [`decompose`][vae_ddp.harness.effect.decompose] result), from a ``report_scale.json`` content;
    what the factor table and the factor pages show."""
    out = {key: result["variants"][name]["effect"] for key, name in FACTOR_VARIANTS.items()
           if name in result["variants"] and result["variants"][name].get("effect")}
    plotted = (result.get("logging") or {}).get("effect")
    if plotted:  # logging changes no gradient: what it does to the plotted value
        out["logging"] = dict(plotted, kind=min((plotted[q]["kind"] for q in ("kl", "reconstruction")),
                                                key=_kinds().index))
    return out


def _kinds() -> tuple[str, ...]:
    from vae_ddp.harness import effect as stats

    return stats.KINDS


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
        variants: names from [`VARIANTS`][vae_ddp.studies.report_scale.VARIANTS] (default: all).
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
                   steps=steps, seeds=[seed], max_samples=max_samples, accelerator=accelerator).exact()
    ref_spec = dataclasses.replace(base, config="single", label="single").validate()
    specs = {n: dataclasses.replace(base, config=VARIANTS[n][0], label=n, **VARIANTS[n][1]).validate() for n in names}
    n_train = _train_size(ref_spec)
    if n_train < (steps + spread_batches) * global_batch_size:
        from vae_ddp.errors import UserError

        raise UserError(f"{n_train} training images are too few for {steps} steps and {spread_batches} spread batches "
                        f"of {global_batch_size} in one epoch: lower --grad_steps, --effect_batches or "
                        "--spread_batches, or use more data")
    runs = _run_all([(ref_spec, "single", 0)]
                    + [(specs[name], f"variant{i}", spread_batches if name == DEFAULT_VARIANT else 0)
                       for i, name in enumerate(names)], out,
                   keep=grad_steps, sketch=SKETCH if effect_batches else 0)
    result = _compare(runs, specs, names)
    result["settings"] = {**dataclasses.asdict(ref_spec), "grad_steps": grad_steps, "spread_batches": spread_batches,
                          "effect_batches": effect_batches,
                          "train_samples": n_train, "world_size": devices, "variants": names}
    result = {key: result[key] for key in ("settings", "grad_norm", "batch_noise", "variants", "logging", "spread")}
    result["reduction"] = _reduction(n_train, global_batch_size, devices)
    result["ranking"] = ranking(result)
    _write(result, out)
    return result


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
                                    entry=[sys.executable, "-m", "vae_ddp.studies.report_scale"])
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
            "ratio_to_batch_noise": {g: diff[g] / noise[g] for g in GROUPS},
            "ratio_per_step": [d["all"] / noise["all"] for d in per_step],
        }
        if name == DEFAULT_VARIANT:
            result["logging"], result["spread"] = _logging(info)
    if runs["single"][0]["sketches"]:
        effects = _effects(runs, names)
        for i, name in enumerate(names):
            result["variants"][name]["effect"] = effects[name]
        if result["logging"]:
            result["logging"]["effect"] = logging_effect(result["logging"])
    return result


#: The quantities each variant's effect is measured on: the gradient Adam receives, and the
#: global batch's loss terms (what the report's curves show, over the whole batch).
QUANTITIES = ("gradient", "kl", "reconstruction")
#: How the tables name the quantities.
LABELS = {"gradient": "gradient", "kl": "KL", "reconstruction": "reconstruction"}
#: A row is the same step as one device's within this many times the floor (the largest relative
#: difference of ``ddp, every fix``): the audit's and the equivalence study's rule.
FLOOR_RATIO = FLOOR_FACTOR


def _quantities(saved: dict, info: dict) -> dict[str, list]:
    """One run's rows per quantity: each step's gradient sketch, the global batch's KL and reconstruction."""
    recs = info["records"]
    return {"gradient": [t.numpy() for t in saved["sketches"]], "kl": [r["kl"] for r in recs],
            "reconstruction": [r["recon_loss"] for r in recs]}


def _effects(runs: dict[str, tuple[dict, dict]], names: list[str]) -> dict[str, dict]:
    """Each variant's [`decompose`][vae_ddp.harness.effect.decompose] against ``single`` per quantity
    (``{"gradient": effect, "kl": ..., "reconstruction": ...}`` with ``"kind"``, the most serious of
    the three): the rows are the frozen runs' steps, one global batch each, all from the initial
    weights (one group). The floor: ``FLOOR_RATIO`` times the largest relative difference of
    ``ddp, every fix`` where it ran (0 where it did not: only the same bits are ``exact``)."""
    from vae_ddp.harness import effect as stats

    x = _quantities(*runs["single"])
    ys = {name: _quantities(*runs[f"variant{i}"]) for i, name in enumerate(names)}
    floor = dict.fromkeys(QUANTITIES, 0.0)
    if "ddp, every fix" in ys:
        floor = {q: FLOOR_RATIO * stats.decompose(x[q], ys["ddp, every fix"][q])["largest_row"] for q in QUANTITIES}
    out = {}
    for name, y in ys.items():
        parts = {q: stats.decompose(x[q], y[q], floor=floor[q]) for q in QUANTITIES}
        out[name] = dict(parts, kind=min((p["kind"] for p in parts.values()), key=stats.KINDS.index), floor=floor)
    return out


def logging_effect(logging: dict) -> dict[str, dict]:
    """What logging rank 0's mean does to the plotted value: [`decompose`][vae_ddp.harness.effect.decompose]
    of the logged KL and reconstruction (rank 0's half batch) against the global batch's, step by step
    (``{"kl": effect, "reconstruction": effect}``): a bias would shift the curve, a noise ratio above 1
    makes it noisier."""
    from vae_ddp.harness import effect as stats

    return {"kl": stats.decompose(logging["global_kl"], logging["logged_kl"]),
            "reconstruction": stats.decompose(logging["global_recon"], logging["logged_recon"])}


def _write(result: dict, out: Path) -> None:
    """``report_scale.json``, ``tables.md``, ``command.md`` and ``report_scale.png`` in ``out``; the tables printed."""
    from vae_ddp.harness.table import write_tables

    tables = render(result)
    with result_set(out) as new:
        (new / "report_scale.json").write_text(json.dumps(result, indent=1))
        write_tables(new, tables)
        (new / "command.md").write_text(command_md(result, out))
        plot(result, new / "report_scale.png")
    print(tables)
    print(f"wrote {out / 'report_scale.json'}, {out / 'tables.md'}, {out / 'command.md'} "
          f"and {out / 'report_scale.png'}")


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


# --------------------------------------------------------------------------- rendering
def _f(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if v == 0:
        return "0"
    return f"{v:.3g}" if 1e-3 <= abs(v) < 1e4 else f"{v:.2e}"


#: How a table cell words an effect's kind at the report's scale.
CELL = {"different": "trains another model", "same distribution": "other luck only", "exact": "the same step",
        "inconclusive": "not resolved"}


def effect_cell(e: dict) -> str:
    """An effect's kind and, where it is ``different``, what was detected: ``trains another model:
    bias 0.82 sd``, ``... noise 1.9x``; ``other luck only``; ``the same step``; ``not resolved``."""
    words = CELL[e["kind"]]
    if e["kind"] != "different":
        return words
    parts = []
    if e["bias_ci"][0] > 0:
        parts.append(f"bias {_f(e['bias'])} sd")
    lo, hi = e["variance_ratio_ci"]
    if lo > 1 or hi < 1:
        parts.append(f"noise {_f(e['variance_ratio'])}x")
    return f"{words}: {', '.join(parts)}"


def logging_cell(e: dict) -> str:
    """What logging rank 0's mean does to the plotted curve: ``shifted 0.4 sd``, ``noisier 2.3x``,
    ``quieter 0.6x``, ``the same values`` or ``not resolved``."""
    if e["kind"] in ("same distribution", "exact"):
        return "the same curve" if e["kind"] == "exact" else "the same curve, other luck"
    if e["kind"] == "inconclusive":
        return "not resolved"
    parts = []
    if e["bias_ci"][0] > 0:
        parts.append(f"shifted {_f(e['bias'])} sd")
    lo, hi = e["variance_ratio_ci"]
    if lo > 1:
        parts.append(f"noisier {_f(e['variance_ratio'])}x")
    elif hi < 1:
        parts.append(f"quieter {_f(e['variance_ratio'])}x")
    return ", ".join(parts)


def effect_line(effect: dict) -> str:
    """One sentence for a factor page: what the factor changes in one step at the report's scale, on
    the gradient, the KL and the reconstruction, with the intervals (``effect``: a variant's
    ``{"kind", "gradient", "kl", "reconstruction"}``)."""
    if "gradient" not in effect:  # logging: the plotted value, not the step
        parts = [f"the {LABELS[q]}: {logging_cell(effect[q])} ({_interval(effect[q])})"
                 for q in ("kl", "reconstruction")]
        return ("what Lightning plots under DDP (rank 0's mean) against the global batch's value: on "
                + "; on ".join(parts) + "; it changes no gradient.")
    parts = [f"the {LABELS[q]}: {effect_cell(effect[q])} ({_interval(effect[q])})" for q in QUANTITIES]
    return "on " + "; on ".join(parts) + "."


def _interval(e: dict) -> str:
    b, r = e["bias_ci"], e["variance_ratio_ci"]
    return (f"bias {_f(e['bias'])} sd [{_f(b[0])}, {_f(b[1])}], "
            f"noise ratio {_f(e['variance_ratio'])} [{_f(r[0])}, {_f(r[1])}]")


def _effect_lines(result: dict) -> list[str]:
    """The effects table (a row per variant but the floor, the logged curve last), its key and each
    row's intervals; no lines where the study measured none."""
    from vae_ddp.harness import effect as stats

    s = result["settings"]
    rows = [(VARIANTS[name][2] if name in VARIANTS else v["factor"], name, v["effect"])
            for name, v in result["variants"].items() if v.get("effect") and name != "ddp, every fix"]
    if not rows:
        return []
    order = {r["variant"]: i for i, r in enumerate(ranking(result))}
    rows.sort(key=lambda r: (r[1] != DEFAULT_VARIANT, order.get(r[1], len(order))))
    lines = [f"What each factor changes in one step ({s['model']} VAE, global batch "
             f"{s['global_batch_size']}, {s['world_size']} ranks x {s['global_batch_size'] // s['world_size']}, "
             f"{s['effect_batches']} global batches from the same initial weights)", "",
             "| factor | gradient | KL | reconstruction |", "|---|---|---|---|"]
    lines += [f"| {factor} | {effect_cell(e['gradient'])} | {effect_cell(e['kl'])} "
              f"| {effect_cell(e['reconstruction'])} |" for factor, _, e in rows]
    lg = (result.get("logging") or {}).get("effect")
    if lg:
        lines.append(f"| Logging (the plotted value) | - | {logging_cell(lg['kl'])} "
                     f"| {logging_cell(lg['reconstruction'])} |")
    floor = result["variants"].get("ddp, every fix", {}).get("effect", {}).get("floor")
    lines += ["", "Each cell compares DDP's step with one device's over the same global batches (DDP's own where its "
              "sampler takes others) and draws: **trains another model**, DDP's step is off one device's on average "
              "(a bias, in one device's step-to-step standard deviations, sd) or varies more or less (a noise ratio, "
              f"DDP's variance over one device's), detected at {stats.CONFIDENCE:.0%}; **other luck only**, both shown "
              f"within their margins (a bias below {stats.BIAS_MARGIN:g} sd, a noise ratio between "
              f"{1 / stats.RATIO_MARGIN:g} and {stats.RATIO_MARGIN:g}): what other samples or draws of the same "
              "distribution do; **the same step**, every batch within "
              + (f"{FLOOR_RATIO:g}x the rounding of DDP with every fix ({_f(floor['gradient'] / FLOOR_RATIO)} of the "
                 "gradient)" if floor else "the same bits")
              + "; **not resolved**, neither shown with these batches. Logging compares what Lightning plots under DDP "
              f"(rank 0's mean of {s['global_batch_size'] // s['world_size']}) with the global batch's value.", "",
              f"Intervals ({stats.CONFIDENCE:.0%}):", ""]
    for factor, _, e in rows:
        lines += [f"- {factor}, {LABELS[q]}: {_interval(e[q])}" for q in QUANTITIES]
    if lg:
        lines += [f"- Logging, {LABELS[q]}: {_interval(lg[q])}" for q in ("kl", "reconstruction")]
    return lines + [""]


def render(result: dict) -> str:
    """The Markdown tables of ``result`` (what the study prints and writes to ``tables.md``): the
    effects (where measured), then the one-step gradient difference, logging and the mean reduction."""
    s = result["settings"]
    head = (f"{s['model']} VAE, {s['data']}, global batch {s['global_batch_size']} "
            f"({s['world_size']} ranks x {s['global_batch_size'] // s['world_size']} for ddp), {s['dtype']}, "
            f"frozen initial weights, {s['grad_steps']} global batches")
    lines = _effect_lines(result)
    lines += [f"Gradient difference to one device on the same global batch, over the batch-to-batch noise of one "
              f"device ({head}): a size, not a kind (another draw and another model look alike here)", "",
              "| factor (variant) | ratio to batch noise | encoder | fc_mu/fc_var | decoder |",
              "|---|---|---|---|---|"]
    for name, v in result["variants"].items():
        r = v["ratio_to_batch_noise"]
        factor = VARIANTS[name][2] if name in VARIANTS else v["factor"]
        lines.append(f"| {factor} ({name}) | **{_f(r['all'])}** | {_f(r['encoder'])} | {_f(r['fc_mu/fc_var'])} | "
                     f"{_f(r['decoder'])} |")
    n, g = result["batch_noise"], result["grad_norm"]
    lines += ["", f"Batch-to-batch noise of one device: mean ||g(batch k) - g(batch k')|| = {_f(n['all'])}, "
              f"mean gradient norm ||g|| = {_f(g['all'])} (ratio {_f(n['all'] / g['all'])})"]
    lg, sp = result.get("logging"), result.get("spread")
    if lg:
        lines += ["", f"What Lightning logs under DDP (rank 0's mean of {s['global_batch_size'] // s['world_size']}) "
                      f"against the global-batch value, over {lg['batches']} batches at the frozen weights", "",
                  "| term | mean abs(logged - global) over mean abs(global k - global k') | "
                  "spread of logged / spread of global | per-sample variance / mean^2 |",
                  "|---|---|---|---|"]
        lines.append(f"| KL | {_f(lg['kl_ratio'])} | {_f(sp['kl_spread_ratio']) if sp else '-'} | "
                     f"{_f(sp.get('relvar_kl')) if sp else '-'} |")
        lines.append(f"| reconstruction (MSE) | {_f(lg['recon_ratio'])} "
                     f"| {_f(sp['recon_spread_ratio']) if sp else '-'} "
                     f"| {_f(sp.get('relvar_recon')) if sp else '-'} |")
    red = result["reduction"]
    lines += ["", f"Mean reduction: {red['train_samples']} training images, {red['padded_samples']} padded by "
                  f"DistributedSampler; per-rank batches are equal at every step (last: {red['per_rank_last_batch']} "
                  f"per rank), so the mean of rank means is the global mean on "
                  f"{'every step' if not red['unequal_steps_per_epoch'] else 'every step but one per epoch'}."]
    return "\n".join(lines)


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


if __name__ == "__main__":
    from vae_ddp.harness.launch import run_job

    sys.exit(run_job(sys.argv[1:], lambda d: RunSpec(**d), _frozen_runs))
