"""Equivalence: with every fix on, does Lightning DDP compute what one device computes?

``vae-ddp equivalence --world_sizes '[2, 4]' --dtype float64 --out DIR`` trains ``single`` and
``ddp`` at each world size from the same seed, data and global batch size with every fix
on ([`exact`][vae_ddp.harness.configs.RunSpec.exact]), through Lightning's ``Trainer``, and
compares them step by step from the same weights (teacher forcing): every step of the DDP
run starts from the one-device run's weights at that step, and its all-reduced gradient and
BatchNorm buffers are compared with one device's.

What "to the last digits" means is measured in the same run, not assumed: one-device runs
that start every step from the same weights but with the samples inside each batch permuted
([`WithinBatchPermutation`][vae_ddp.harness.permutation.WithinBatchPermutation]) compute
mathematically the same step (the same samples, each with its own noise; a mean and
BatchNorm statistics do not depend on the order), so their differences are rounding alone:
the *reordering floor*, several draws of it per step. DDP sums the same terms in another
grouping (per rank, then across ranks) and matches one device when its largest per-step
difference is at most [`FLOOR_FACTOR`][vae_ddp.harness.permutation.FLOOR_FACTOR] times the
largest draw of the floor. Comparing final parameters after K steps instead is a noisy
yardstick: Adam carries a last-bit difference of one step into every later one, so the
same comparison of two permuted one-device runs moves by orders of magnitude with the draw.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Optional

import torch

from vae_ddp.errors import UserError
from vae_ddp.harness.configs import RunSpec
from vae_ddp.harness.launch import launch_by_world_size
from vae_ddp.harness.permutation import FLOOR_FACTOR
from vae_ddp.harness.table import format_table, number, write_tables
from vae_ddp.outputs import drop_tensors, result_set

__all__ = ["equivalence", "max_abs_diff", "param_diffs", "verdict"]


def _is_buffer(name: str) -> bool:
    return name.endswith(("running_mean", "running_var", "num_batches_tracked"))


def param_diffs(a: dict, b: dict, buffers: bool = False) -> dict[str, float]:
    """``{name: max |a[name] - b[name]|}`` over the floating-point parameters of two state
    dicts (or over their BatchNorm buffers), computed in float64."""
    keys = [k for k in a if _is_buffer(k) == buffers and a[k].is_floating_point()]
    return {k: float((a[k].double() - b[k].double()).abs().max()) for k in keys}


def max_abs_diff(a: dict, b: dict, buffers: bool = False) -> float:
    """Largest absolute difference between two state dicts, over parameters (or BatchNorm buffers)."""
    return max(param_diffs(a, b, buffers).values(), default=0.0)


def _ratio(d: float, floor: float) -> Optional[float]:
    if floor > 0:
        return d / floor
    return 0.0 if d == 0 else None  # None: a difference over a zero floor (JSON has no infinity)


def _g(v: Optional[float]) -> str:
    """3 significant digits, scientific below 1e-3; None (no floor) is ``inf``."""
    return number(v, none="inf", sci_below=1e-3)


def verdict(ratio: Optional[float], outliers: Optional[list[int]] = None, typical: Optional[float] = None,
            steps: Optional[int] = None) -> str:
    """The wording of one world size's result, from its ratio to the floor (its largest step)
    and, when given, the steps beyond ``FLOOR_FACTOR`` (``outliers``, 0-based), the median
    step's ratio (``typical``) and the number of steps. A result beyond the floor is never
    worded as a match: when most steps are within it, the wording says which are not."""
    if ratio is None:
        return "differs where one device does not"
    if ratio <= FLOOR_FACTOR:
        return f"within {FLOOR_FACTOR:g}x of the one-device floor"
    if outliers and typical is not None and typical <= FLOOR_FACTOR and steps and len(outliers) < steps:
        which = ", ".join(str(k) for k in outliers)
        return (f"within {FLOOR_FACTOR:g}x of the floor at {steps - len(outliers)} of {steps} steps; "
                f"step{'s' if len(outliers) > 1 else ''} {which} up to {ratio:.3g}x")
    return f"{ratio:.3g}x the one-device floor: more than reordering explains"


def _summary(result: dict) -> str:
    """One sentence over all world sizes, chosen from the ratios."""
    ws = result["world_sizes"]
    ok = [n for n, e in ws.items() if e["within_floor"]]
    head = f"{result['dtype']}, {result['optimizer']}, every step started from one device's weights: "
    if len(ok) == len(ws):
        worst = max((e["ratio_to_floor"] for e in ws.values()), default=0.0)
        return (head + f"DDP at world size {', '.join(ws)} matches one device: its gradient differs from one "
                f"device's by at most {FLOOR_FACTOR:g}x the largest difference that permuting the "
                f"samples of the batch makes on one device ({_g(result['floor'])} relative; largest ratio "
                f"{_g(worst)}).")
    bad = [n for n in ws if n not in ok]
    few = [n for n in bad if ws[n]["outlier_steps"] and ws[n]["typical_ratio"] is not None
           and ws[n]["typical_ratio"] <= FLOOR_FACTOR]
    text = (head + f"DDP at world size {', '.join(bad)} differs from one device by more than {FLOOR_FACTOR:g}x the "
            f"largest difference that permuting the samples makes on one device ({_g(result['floor'])} relative)")
    if few:
        text += (f"; at world size {', '.join(few)} only at some steps, the median step being within the floor "
                 f"(`grad_steps` in equivalence.json)")
    return text + "."


def _steps(result: tuple[dict, Path]) -> dict:
    """Per-step record (``grads``, ``buffers``) of one spec's result of ``launch_by_world_size``."""
    run = result[0]["runs"][0]
    return torch.load(result[1] / run["steps"])


def _per_step(record: dict, ref: dict, key: str) -> list[float]:
    from vae_ddp.probes import per_step_differences

    return per_step_differences(record[key], ref[key])


def equivalence(base: RunSpec, world_sizes: list[int], out_dir: Path, permutations: int = 4) -> dict:
    """Run the comparison; write and return ``out_dir/equivalence.json``::

        {"dtype", "optimizer", "steps", "model", "floor_factor", "method": "teacher-forced",
         (per world size also "buffer_ratio_to_floor" and "buffer_eps": the BatchNorm buffers'
         largest difference over their permuted floor and in machine epsilons; reported, not judged;
         "outlier_steps": the steps beyond FLOOR_FACTOR x the floor, "typical_ratio": the median
         step's ratio)
         "floor": the largest per-step relative difference of any permuted run,
         "floor_runs": [the largest per-step difference of each permuted run],
         "floor_steps": [[per-step relative gradient difference] per permuted run],
         "floor_calibration": the largest ratio of one permuted run to the others' floor,
         "single": settings,
         "world_sizes": {N: {"max_grad_diff", "max_buffer_diff", "ratio_to_floor", "within_floor",
                             "steps_within_draws", "grad_steps", "buffer_steps", "verdict",
                             "settings"}},
         "summary": one sentence}

    The comparison is *teacher-forced*: the one-device run records its weights θ_k
    (parameters and buffers) at the start of every step k; every other run (the permuted
    one-device runs and DDP at each world size, real Lightning DDP with every fix on) starts
    each step from that θ_k ([`StepProbe`][vae_ddp.probes.StepProbe]) and its gradient (after
    DDP's all-reduce) and BatchNorm buffers after the step are compared with one device's:
    ``||g - g_single|| / ||g_single||``. Each step starts from the same weights, so nothing is
    carried over from earlier steps: no chaotic amplification (a trajectory after K Adam steps
    moves by orders of magnitude with the order of the samples alone), only what each step
    computes differently.

    Args:
        base: the run's settings (model, data, steps, global batch size, dtype, optimizer, seed);
            the fixes are all turned on here.
        world_sizes: DDP world sizes to compare with one device.
        out_dir: where the runs and ``equivalence.json`` go.
        permutations: one-device runs that permute the samples inside every batch with their
            own seed ([`WithinBatchPermutation`][vae_ddp.harness.permutation.WithinBatchPermutation]):
            the same loss summed in another order, i.e. a draw of rounding alone at every step.


    The floor is the largest per-step difference over all permuted runs and steps;
    ``ratio_to_floor`` is DDP's largest per-step gradient difference over it, and DDP matches
    when it is at most :data:`FLOOR_FACTOR`.
    The verdict judges the gradient, what the optimizer receives; BatchNorm's running statistics
    are reported beside it in machine epsilons (their sums are short and permuting them moves
    them less than DDP's per-rank grouping does, so their permuted floor is too tight a
    yardstick).
    ``floor_calibration`` applies the same rule to each permuted run against the others: a
    value above :data:`FLOOR_FACTOR` would mean the rule flags rounding itself.

    Raises:
        UserError: ``permutations`` below 2 (the calibration needs two draws), a world size below 1.
    """
    if min(world_sizes, default=0) < 1:
        raise UserError(f"--world_sizes must be positive integers, got {world_sizes}")
    if permutations < 2:
        raise UserError(f"--permutations must be at least 2 (the floor is a distribution of draws), got {permutations}")
    out_dir = Path(out_dir)
    reference = out_dir / "runs" / "single-steps.pt"
    exact = dataclasses.replace(base, save_params=False, val_every=0, seeds=base.seeds[:1],
                                steps_file=str(reference.resolve())).exact()
    single = dataclasses.replace(exact, config="single", label="single").validate()
    forced = dataclasses.replace(single, teacher_forced=True)
    permuted = [dataclasses.replace(forced, label=f"single, permuted {k}", permute_seed=k)
                for k in range(1, permutations + 1)]
    ddps = [dataclasses.replace(exact, config="ddp", devices=n, label=f"ddp-{n}", teacher_forced=True).validate()
            for n in world_sizes]
    reference.parent.mkdir(parents=True, exist_ok=True)
    # one launch: single (the reference, first) and the permuted runs share one process, then each world size
    # the same intra-op threads everywhere: each rank's forward is then one device's bit for bit (MKL's
    # float32 product rounds otherwise at another thread count, or below 16 rows); a ReLU input within
    # rounding of zero flipped by a forward difference moves a step by 1e-3, which no permuted draw shows
    launched = launch_by_world_size([single, *permuted, *ddps], out_dir / "runs", same_threads=True)
    try:
        result, text = _compare(base, single, permuted, ddps, launched)
    finally:
        drop_tensors(out_dir / "runs")
    with result_set(out_dir) as new:
        (new / "equivalence.json").write_text(json.dumps(result, indent=1))
        write_tables(new, text)
    print(text)
    return result


def _compare(base: RunSpec, single: RunSpec, permuted: list[RunSpec], ddps: list[RunSpec],
             launched: list[tuple[dict, Path]]) -> tuple[dict, str]:
    """The equivalence result and its text from the launched runs' per-step records."""
    ref = _steps(launched[0])
    floor_steps, floor_buffers, rows = [], [], []
    for spec, run in zip(permuted, launched[1:]):
        rec = _steps(run)
        floor_steps.append(_per_step(rec, ref, "grads"))
        floor_buffers.append(_per_step(rec, ref, "buffers"))
        eps = torch.finfo(torch.float64 if base.dtype == "float64" else torch.float32).eps
        rows.append([f"1, samples permuted (seed {spec.permute_seed})", "one draw of the floor",
                     _g(max(floor_steps[-1])), "-", f"{max(floor_buffers[-1]) / eps:.2g} eps"])
    floor_runs = [max(f) for f in floor_steps]
    floor = max(floor_runs)
    buffer_floor = max(max(f) for f in floor_buffers)
    calibration = max((_ratio(floor_runs[i], max(floor_runs[:i] + floor_runs[i + 1:])) or 0.0)
                      for i in range(len(floor_runs)))
    result = {"dtype": base.dtype, "optimizer": base.optimizer, "steps": base.steps, "model": base.model,
              "method": "teacher-forced", "floor_factor": FLOOR_FACTOR, "floor": floor, "floor_runs": floor_runs,
              "floor_steps": floor_steps, "buffer_floor": buffer_floor, "floor_calibration": calibration,
              "single": dataclasses.asdict(single), "world_sizes": {}}
    per_step_floor = [max(col) for col in zip(*floor_steps)]
    for spec, run in zip(ddps, launched[1 + len(permuted):]):
        rec = _steps(run)
        grads, bufs = _per_step(rec, ref, "grads"), _per_step(rec, ref, "buffers")
        ratio = _ratio(max(grads), floor)
        outliers = [k for k, d in enumerate(grads) if d > FLOOR_FACTOR * floor]
        typical = _ratio(statistics.median(grads), floor)
        eps = torch.finfo(torch.float64 if base.dtype == "float64" else torch.float32).eps
        entry = {"max_grad_diff": max(grads), "max_buffer_diff": max(bufs), "ratio_to_floor": ratio,
                 "buffer_ratio_to_floor": _ratio(max(bufs), buffer_floor), "buffer_eps": max(bufs) / eps,
                 "within_floor": ratio is not None and ratio <= FLOOR_FACTOR,
                 "steps_within_draws": sum(d <= f for d, f in zip(grads, per_step_floor)),
                 "outlier_steps": outliers, "typical_ratio": typical,
                 "grad_steps": grads, "buffer_steps": bufs, "verdict": verdict(ratio, outliers, typical, len(grads)),
                 "settings": dataclasses.asdict(spec)}
        result["world_sizes"][str(spec.devices)] = entry
        rows.append([f"{spec.devices} (per-device batch {spec.per_device_batch_size})", entry["verdict"],
                     _g(max(grads)), _g(ratio), f"{entry['buffer_eps']:.2g} eps"])
    result["summary"] = _summary(result)
    table = format_table(["world size", "verdict", "gradient: largest step difference", "ratio to floor",
                          "BatchNorm buffers"], rows,
                         title=f"{base.model} VAE, {base.data}, global batch {base.global_batch_size}, {base.steps} "
                               f"steps each started from one device's weights, {base.dtype}, {base.optimizer}, all "
                               f"fixes on; relative differences to one device")
    text = (f"{result['summary']}\n\n{table}\n\nThe verdict compares the gradient. The permuted runs against "
            f"each other: the largest is {_g(calibration)}x the others' floor. BatchNorm buffers: the largest relative "
            f"difference after a step, in machine epsilons of {base.dtype} (eps = "
            f"{torch.finfo(torch.float64 if base.dtype == 'float64' else torch.float32).eps:.3g}).")
    return result, text
