"""The long-horizon check: does noise shared across ranks shift the KL over thousands of steps?

Under Lightning's default DDP every rank is seeded alike, so with N ranks the global
batch's reparameterization noise is N copies of one draw: ``eps = cat([e] * N)`` with
``e`` drawn for ``B / N`` rows. The gradient is then an average over fewer independent
noise draws, so its variance is higher; Adam divides each step by the square root of its
running second moment of the gradient, so a higher variance means smaller steps, which
could shift the KL (and the reconstruction) systematically over a long run. Short runs
cannot show a slow drift; this study trains long enough to see one.

It runs on one device, in one process per run, and compares two noise modes, every other
thing equal:

- ``shared``: [`SharedNoise`][vae_ddp.studies.long_horizon.SharedNoise], the default DDP
  noise emulated on one device. With the global batch dealt to the ranks in contiguous
  chunks ([`GlobalBatchDistributedSampler`][vae_ddp.fixes.sampler.GlobalBatchDistributedSampler])
  and BatchNorm over the global batch, this computes what DDP with N ranks computes
  (checked against real 2-rank DDP in float64 by ``tests/studies/test_long_horizon.py``).
- ``independent``: one independent ``eps`` per sample, as one device draws it.

Both use the same sampler (seeded by the run's seed), so run i of each mode shares its
initial weights and its data order: only the noise differs, and the comparison is paired
by seed. Each final quantity is compared with [`compare_metrics`][vae_ddp.harness.stats.compare_metrics]
(paired t-test, TOST with a margin of ``margin_sd`` standard deviations of the
``independent`` runs, Holm over the four quantities).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import torch
from pytorch_lightning import Callback, LightningModule, Trainer
from torch import Tensor

from vae_ddp.errors import UserError
from vae_ddp.forking import spawned_map
from vae_ddp.model import standard_normal_noise
from vae_ddp.harness.configs import RunSpec
from vae_ddp.harness.stats import QUANTITIES, compare_metrics, finals
from vae_ddp.harness.table import number, write_tables
from vae_ddp.outputs import result_set, write_atomic

__all__ = ["SharedNoise", "train_run", "long_horizon", "render", "NOISE"]

#: The two noise modes compared: DDP's default (shared across ranks) and one device's.
NOISE = ("shared", "independent")


class SharedNoise(Callback):
    """Default DDP reparameterization noise, emulated on one device.

    Each DDP rank draws ``torch.empty_like(mu).normal_()`` for its ``B / N`` rows from its
    global generator, and ``seed_everything`` seeded every rank alike, so every rank draws
    the same rows. On one device with the global batch ``mu: (B, latent_dim)``, this
    draws ``e: (B / N, latent_dim)`` from the global generator the same way and returns
    ``cat([e] * N)``: rows ``[r * B / N, (r + 1) * B / N)`` (rank r's chunk under
    [`GlobalBatchDistributedSampler`][vae_ddp.fixes.sampler.GlobalBatchDistributedSampler]) all get ``e``.

    DDP also restarts the ranks' global generator when the process group is set up:
    ``DDPStrategy.setup_distributed`` calls ``reset_seed()`` (Lightning 2.x,
    ``pytorch_lightning/strategies/ddp.py``), which repeats ``seed_everything`` with the
    seed given before, after the model has drawn its initial weights. With ``reseed`` this
    callback does the same in ``setup`` (after the strategy's setup, before the first
    batch), so that the noise stream, not only its structure, is DDP's.

    Like [`GlobalBatchNoise`][vae_ddp.fixes.noise.GlobalBatchNoise] it sets the module's
    ``noise`` attribute for each training batch and restores it afterwards (validation
    keeps the default stream).

    Args:
        world_size: number of ranks N emulated; the batch size must be a multiple of it.
        reseed: call ``lightning_fabric.utilities.seed.reset_seed()`` in ``setup``, as DDP does.

    Raises:
        ValueError: ``world_size`` below 1.
    """

    def __init__(self, world_size: int = 2, reseed: bool = True) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size, self.reseed = world_size, reseed
        self._saved: Optional[Callable[[Tensor], Tensor]] = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.reseed:
            from lightning_fabric.utilities.seed import reset_seed

            reset_seed()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._saved = getattr(pl_module, "noise", standard_normal_noise)
        pl_module.noise = self

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        pl_module.noise = self._saved or standard_normal_noise

    def __call__(self, mu: Tensor) -> Tensor:
        """``eps`` of ``mu``'s shape, dtype and device, ``mu: (B, latent_dim)``; ``B`` must be a
        multiple of ``world_size`` (raises ``ValueError`` otherwise)."""
        if mu.shape[0] % self.world_size:
            raise ValueError(f"batch of {mu.shape[0]} rows is not divisible by world size {self.world_size}")
        e = torch.empty((mu.shape[0] // self.world_size, *mu.shape[1:]), dtype=mu.dtype, device=mu.device).normal_()
        return e.repeat(self.world_size, *([1] * (mu.dim() - 1)))


def train_run(spec: RunSpec, seed: int, noise: Literal["shared", "independent"], world_size: int = 2) -> dict:
    """Train ``spec`` (``config="single"``, already validated) on one device with ``seed``.

    ``noise="shared"`` adds [`SharedNoise`][vae_ddp.studies.long_horizon.SharedNoise]
    (``world_size`` ranks emulated); ``"independent"`` keeps the default noise. Returns
    ``{"seed", "noise", "records", "val_records", "model"}``: the records of
    [`GlobalBatchRecorder`][vae_ddp.recording.GlobalBatchRecorder] and the trained module.

    Raises:
        ValueError: unknown ``noise``.
    """
    import pytorch_lightning as pl

    from vae_ddp.data import make_datamodule
    from vae_ddp.recording import GlobalBatchRecorder
    from vae_ddp.harness.runner import build_model, build_trainer

    if noise not in NOISE:
        raise ValueError(f"unknown noise mode {noise!r}: use one of {', '.join(NOISE)}")
    pl.seed_everything(seed, verbose=False)
    dm = make_datamodule(spec.data, spec.data_dir, global_batch_size=spec.global_batch_size,
                         max_samples=spec.max_samples, sampler=spec.sampler, sampler_seed=seed)
    model = build_model(spec, seed)
    recorder = GlobalBatchRecorder(spec.steps, spec.val_every, f"{noise} seed {seed}", progress=False)
    callbacks: list[Callback] = [recorder] + ([SharedNoise(world_size)] if noise == "shared" else [])
    trainer = build_trainer(spec, seed, callbacks)
    trainer.fit(model, datamodule=dm)
    return {"seed": seed, "noise": noise, "records": recorder.records, "val_records": recorder.val_records,
            "model": model}


def _task(spec_json: str, seed: int, noise: str, world_size: int, window: int, threads: int) -> dict:
    """One run in a worker process: train, then reduce the curves to means over ``window`` steps."""
    from vae_ddp.utils import quiet

    torch.set_num_threads(threads)
    quiet()
    spec = RunSpec.from_json(spec_json)
    t0 = time.perf_counter()
    run = train_run(spec, seed, noise, world_size)  # type: ignore[arg-type]
    recs = run["records"]
    chunks = [recs[i:i + window] for i in range(0, len(recs), window)]
    curve = {"step": [c[-1]["step"] for c in chunks]}
    for k in ("kl", "recon_loss"):
        curve[k] = [statistics.fmean(r[k] for r in c) for c in chunks]
    return {"seed": seed, "noise": noise, "seconds": time.perf_counter() - t0, "curve": curve,
            "final": finals(recs, run["val_records"][-1])}


def long_horizon(out_dir: Path, num_seeds: int = 10, steps: int = 2000, global_batch_size: int = 64,
                 world_size: int = 2, data: str = "imagefolder", data_dir: Optional[str] = None,
                 max_samples: Optional[int] = None, lr: float = 1e-4, margin_sd: float = 1.0, jobs: int = 2,
                 window: int = 20, resume: bool = True) -> dict:
    """Run the long-horizon check; write ``long-horizon.json``, ``tables.md`` and ``long-horizon.png``
    into ``out``; return the JSON content.

    Args:
        out_dir: output folder; per-run results go to ``out_dir/runs/<noise>-<seed>.json``.
        num_seeds: seeds 0 .. num_seeds - 1 of each noise mode (at least 3).
        steps: optimizer steps per run (Adam, ``lr``).
        global_batch_size: samples per step (B), a multiple of ``world_size``.
        world_size: ranks N whose shared noise is emulated.
        data, data_dir, max_samples: the images (see [`make_datamodule`][vae_ddp.data.make_datamodule]).
        lr: Adam learning rate (1e-4, the report's).
        margin_sd: equivalence margin, in standard deviations (over seeds) of the
            ``independent`` runs' final value of each quantity.
        jobs: runs trained at once, one process each (threads per run: CPU count / jobs).
        window: the JSON keeps the train curves as means over this many steps.
        resume: reuse ``out_dir/runs/*.json`` written with the same settings instead of training again.

    Returns:
        ``{"settings", "num_seeds", "runs", "comparison", "verdict", "summary", "seconds"}``:
        ``runs[noise]`` the per-seed curves and final values, ``comparison`` the entries of
        [`compare_metrics`][vae_ddp.harness.stats.compare_metrics] per quantity,
        ``verdict`` one of ``"equivalent"`` (every quantity), ``"different"`` (any
        quantity) or ``"inconclusive"``; ``summary`` one sentence.

    Raises:
        UserError: bad settings (one line, before any training).
    """
    _check(num_seeds, world_size, global_batch_size, margin_sd, jobs, window)
    spec = RunSpec(config="single", sampler="global", steps=steps, global_batch_size=global_batch_size, data=data,
                   data_dir=data_dir, max_samples=max_samples, lr=lr, val_every=steps, label="long-horizon").validate()
    out = Path(out_dir)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    settings = dataclasses.asdict(spec) | {"config": None, "seeds": list(range(num_seeds)),
                                           "world_size": world_size, "window": window}
    runs = _train_all(spec, settings, out, num_seeds, world_size, jobs, window, resume)
    by_noise = {n: [runs[s, n] for s in range(num_seeds)] for n in NOISE}
    values = {n: {q: [r["final"][q] for r in rs] for q in QUANTITIES} for n, rs in by_noise.items()}
    margins = {q: margin_sd * statistics.stdev(values["independent"][q]) for q in QUANTITIES}
    comparison = compare_metrics(values["shared"], values["independent"], margins, pair=True)
    result = {"settings": settings, "num_seeds": num_seeds, "margin_sd": margin_sd, "runs": by_noise,
              "comparison": comparison, "train_seconds": sum(r["seconds"] for r in runs.values())}
    result["verdict"], result["summary"] = overall(comparison, world_size, steps)
    _write(out, result)
    print(render(result))
    return result


def _write(out: Path, result: dict) -> None:
    """``long-horizon.json``, ``tables.md`` and ``long-horizon.png`` into ``out``, as one set."""
    with result_set(out) as new:
        (new / "long-horizon.json").write_text(json.dumps(result, indent=1))
        write_tables(new, render(result))
        plot(result, new / "long-horizon.png")


def _check(num_seeds: int, world_size: int, global_batch_size: int, margin_sd: float, jobs: int,
           window: int) -> None:
    """Bad settings: one ``UserError`` line, before any training."""
    if num_seeds < 3:
        raise UserError(f"--num_seeds must be at least 3 for a paired test, got {num_seeds}")
    if world_size < 2:
        raise UserError(f"--world_size must be at least 2 (ranks that share the noise), got {world_size}")
    if global_batch_size % world_size:
        raise UserError(f"--global_batch_size {global_batch_size} is not divisible by --world_size {world_size}")
    if not margin_sd > 0:
        raise UserError(f"--margin_sd must be positive, got {margin_sd}")
    if jobs < 1 or window < 1:
        raise UserError(f"--jobs and --window must be at least 1, got {jobs} and {window}")


def _train_all(spec: RunSpec, settings: dict, out: Path, num_seeds: int, world_size: int, jobs: int, window: int,
               resume: bool) -> dict[tuple[int, str], dict]:
    """Every (seed, noise) run: reused from ``out/runs/<noise>-<seed>.json`` when written with the
    same ``settings`` (and ``resume``), else trained, ``jobs`` at a time, and saved there."""
    steps, global_batch_size = spec.steps, spec.global_batch_size
    threads = max(1, (os.cpu_count() or 1) // jobs)
    tasks = [(s, n) for s in range(num_seeds) for n in NOISE]
    runs: dict[tuple[int, str], dict] = {}
    for s, n in tasks:
        path = out / "runs" / f"{n}-{s}.json"
        if resume and path.exists():
            saved = json.loads(path.read_text())
            if saved.get("settings") == settings:
                runs[s, n] = saved["run"]
    todo = [t for t in tasks if t not in runs]
    print(f"long-horizon: {num_seeds} seeds x {len(NOISE)} noise modes x {steps} steps, global batch "
          f"{global_batch_size}, {world_size} ranks emulated; {len(runs)} runs reused, {len(todo)} to train "
          f"({jobs} at a time)", flush=True)
    t0 = time.perf_counter()
    if todo:  # new interpreters: this process computed with torch's threads (forking.can_fork is false)
        calls = [(spec.to_json(), s, n, world_size, window, threads) for s, n in todo]
        for i, ((s, n), run) in enumerate(zip(todo, spawned_map(_task, calls, jobs))):
            runs[s, n] = run
            write_atomic(out / "runs" / f"{n}-{s}.json", json.dumps({"settings": settings, "run": run}))
            elapsed = time.perf_counter() - t0
            print(f"   {n} seed {s}: {run['seconds']:.0f} s; {elapsed / 60:.1f} min so far, about "
                  f"{elapsed / (i + 1) * (len(todo) - i - 1) / 60:.1f} min to go", flush=True)
    return runs


def overall(comparison: dict[str, dict], world_size: int, steps: int) -> tuple[str, str]:
    """The study's verdict and its one-sentence summary, from the per-quantity verdicts:
    ``"different"`` if any quantity differs, ``"equivalent"`` if all are equivalent,
    else ``"inconclusive"``."""
    verdicts = {q: e["verdict"] for q, e in comparison.items()}
    kl = comparison["train_kl"]
    what = f"noise shared by {world_size} ranks vs independent noise after {steps} steps"
    if "different" in verdicts.values():
        diff = [f"{q} ({e['diff'] / e['mean_b']:+.1%}" + (", within the margin" if e["within_margin"] else "") + ")"
                for q, e in comparison.items() if e["verdict"] == "different"]
        return "different", f"{what}: a systematic difference in {', '.join(diff)}"
    if all(v == "equivalent" for v in verdicts.values()):
        from vae_ddp.harness.stats import margin_interval, margin_level

        k = len(comparison)
        lo, hi = margin_interval(kl, k) or (kl["ci_low"], kl["ci_high"])
        level = margin_level(k) if margin_interval(kl, k) else "95%"
        return "equivalent", (f"{what}: equivalent in every final quantity; train KL differs by {kl['diff']:+.3g} "
                              f"({level} CI {lo:.3g} to {hi:.3g}), within ±{kl['margin']:.3g}")
    undecided = [q for q, v in verdicts.items() if v == "inconclusive"]
    return "inconclusive", (f"{what}: no difference detected, but equivalence is not shown for "
                            f"{', '.join(undecided)}")


_g = number


def _p(p: float) -> str:
    return "<0.001" if p < 0.001 else f"{p:.2g}"


def comparison_table(comparison: dict[str, dict], a: str, b: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of one comparison (``a`` vs the reference ``b``), formatted: the verdict
    and what it rests on (difference, its interval at the level of Holm's correction over the
    quantities, ``margin_interval``, which decides it against the equivalence margin; 95% where the
    comparison has no paired spread). The
    test statistics are in :func:`statistics_table` (two narrow tables fit a page; one wide one does not)."""
    from vae_ddp.harness.stats import margin_interval, margin_level

    k = len(comparison)
    cis = {q: margin_interval(e, k) for q, e in comparison.items()}
    adjusted = all(cis.values())
    head = f"{margin_level(k)} CI (Holm, {k})" if adjusted else "95% CI"
    headers = ["quantity", "verdict", f"difference ({a} - {b})", head, "margin ±"]
    rows = [[q, e["verdict"], _g(e["diff"]),
             "{} to {}".format(*map(_g, cis[q] if adjusted else (e["ci_low"], e["ci_high"]))), _g(e["margin"])]
            for q, e in comparison.items()]
    return headers, rows


#: The title of every statistics table: what its short column names mean.
STATISTICS_TITLE = ("The statistics behind each verdict (p: the difference's, TOST p: the equivalence test's, both "
                    "Holm-adjusted; detectable: the difference found with 80% power; r: correlation of the pairs)")


def statistics_table(comparison: dict[str, dict], a: str, b: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the statistics behind :func:`comparison_table`: the means, the
    Holm-adjusted p of the difference and of the equivalence test (TOST), the difference
    detectable with 80% power and the seed-to-seed correlation ``r`` of the pairs."""
    headers = ["quantity", f"mean {b}", f"mean {a}", "p", "TOST p", "detectable", "r"]
    rows = [[q, _g(e["mean_b"]), _g(e["mean_a"]), _p(e["p_holm"]), _p(e["p_tost_holm"]), _g(e["mde"]),
             f"{e.get('r', float('nan')):.2f}"] for q, e in comparison.items()]
    return headers, rows


def render(result: dict) -> str:
    """The study's verdict, then its table (Markdown), from its ``long-horizon.json`` content."""
    from vae_ddp.harness.table import format_table

    st = result["settings"]
    headers, rows = comparison_table(result["comparison"], "shared", "independent")
    title = (f"{st['model']} VAE, {st['data']}, {result['num_seeds']} seeds x {st['steps']} steps, global batch "
             f"{st['global_batch_size']}, Adam lr {st['lr']:g}: noise shared by {st['world_size']} ranks "
             "vs independent "
             f"(paired by seed; margin {result['margin_sd']:g} SD of the independent runs)")
    s_headers, s_rows = statistics_table(result["comparison"], "shared", "independent")
    return (f"Verdict: **{result['verdict']}**: {result['summary']}.\n\n{format_table(headers, rows, title=title)}"
            f"\n\n{format_table(s_headers, s_rows, title=STATISTICS_TITLE)}")


def plot(result: dict, path: Path) -> None:
    """Mean and ±1 standard deviation over seeds of the train KL and reconstruction per noise
    mode, and the paired difference of the KL with its 95% confidence band."""
    import numpy as np
    from matplotlib.figure import Figure
    from scipy import stats as sps

    fig = Figure(figsize=(14, 4.2), layout="constrained")
    axes = fig.subplots(1, 3)
    runs = result["runs"]
    steps = np.array(runs["shared"][0]["curve"]["step"])
    for i, (n, rs) in enumerate(runs.items()):
        for ax, key in zip(axes[:2], ("kl", "recon_loss")):
            y = np.array([r["curve"][key] for r in rs])
            m, s = y.mean(0), y.std(0, ddof=1)
            ax.plot(steps, m, color=f"C{i}", lw=1.3, label=f"{n} noise: mean of {len(rs)} seeds")
            ax.fill_between(steps, m - s, m + s, color=f"C{i}", alpha=0.2, lw=0, label=f"{n} noise: ±1 SD")
    d = np.array([a["curve"]["kl"] for a in runs["shared"]]) - np.array([b["curve"]["kl"] for b in runs["independent"]])
    m, se = d.mean(0), d.std(0, ddof=1) / np.sqrt(len(d))
    half = sps.t.ppf(0.975, len(d) - 1) * se
    axes[2].plot(steps, m, color="C2", lw=1.3, label="mean paired difference")
    axes[2].fill_between(steps, m - half, m + half, color="C2", alpha=0.25, lw=0, label="95% CI")
    axes[2].axhline(0, color="k", lw=0.8)
    margin = result["comparison"]["train_kl"]["margin"]
    for y in (-margin, margin):
        axes[2].axhline(y, color="k", lw=0.8, ls="--")
    axes[2].plot([], [], color="k", lw=0.8, ls="--", label="final train KL margin")
    w = result["settings"]["window"]
    axes[0].set(title="train KL term (global batch)\nmean ±1 SD over seeds",
                ylabel=f"KL x kl_coeff, mean over {w} steps (log scale)")
    axes[1].set(title="train reconstruction (global batch)\nmean ±1 SD over seeds",
                ylabel=f"MSE, mean over {w} steps (log scale)")
    axes[2].set(title="train KL: shared minus independent\n(paired by seed)",
                ylabel=f"difference of KL x kl_coeff, mean over {w} steps")
    for ax in axes:
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    st = result["settings"]
    fig.suptitle(f"{st['model']} VAE on {st['data']}, global batch {st['global_batch_size']}, "
                 f"{result['num_seeds']} seeds per noise mode")
    from vae_ddp.outputs import save_figure

    save_figure(fig, path)


