"""Equivalence: with every fix on, does Lightning DDP match one device to the last digits?

``vae-ddp equivalence --world-sizes 2 4 --dtype float64 --out DIR`` trains ``single`` and
``ddp`` at each world size from the same seed, data and global batch size with every fix
on ([`exact`][vae_ddp.studies.configs.RunSpec.exact]), through Lightning's ``Trainer``, and compares the final
parameters: ``max |theta_ddp - theta_single|`` over all parameters.

What "to the last digits" means is measured in the same run, not assumed: a second
one-device run trains the same model on the same batches, but with the samples inside
each batch permuted ([`WithinBatchPermutation`][vae_ddp.studies.equivalence.WithinBatchPermutation]).
Its loss is mathematically the same (the same samples, each with its own noise; a mean
and BatchNorm statistics do not depend on the order), so ``max |theta_permuted -
theta_single|`` is what floating-point rounding alone does to one device: the
*reordering floor*. DDP sums the same terms in another grouping (per rank, then across
ranks), so it cannot be expected to come closer to one device than that; each world
size is reported as a multiple of the floor, and matches one device when the multiple is
at most [`FLOOR_FACTOR`][vae_ddp.studies.equivalence.FLOOR_FACTOR].
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from pytorch_lightning import Callback, LightningModule, Trainer
from torch import Tensor

from vae_ddp.errors import UserError
from vae_ddp.studies.configs import RunSpec
from vae_ddp.studies.launch import launch_by_world_size
from vae_ddp.studies.table import format_table, write_tables

__all__ = ["equivalence", "max_abs_diff", "param_diffs", "WithinBatchPermutation", "FLOOR_FACTOR", "verdict"]

#: DDP matches one device when ``max |theta_ddp - theta_single|`` is at most this many
#: times the one-device reordering floor measured in the same run.
FLOOR_FACTOR = 2.0

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


class WithinBatchPermutation(Callback):
    """One device only: permute the samples of each training batch, each keeping its noise.

    At training batch k (counted from the start of ``fit``) the callback draws
    ``perm = torch.randperm(B)`` from a generator seeded with ``seed * 1_000_003 + k`` and
    reorders, in place, every tensor of the batch whose first dimension is ``B``
    (``x: (B, ...)``, the labels ``(B,)``): row ``i`` becomes row ``perm[i]``. It also wraps
    the LightningModule's ``noise`` attribute (``mu -> eps``, the hook that
    [`VAE`][vae_ddp.model.VAE] and the recipe's module draw their reparameterization noise
    through, and that [`GlobalBatchNoise`][vae_ddp.fixes.noise.GlobalBatchNoise] sets): the
    noise of row ``i`` becomes ``noise(mu)[perm[i]]``, the ``eps`` that sample met in the
    unpermuted run. The loss (a mean over the batch), its gradient and the BatchNorm
    statistics are then the same sums in another order: only floating-point rounding can
    tell the two runs apart.

    Put it after any callback that sets ``noise`` (Lightning calls callbacks in list order).
    Lightning converts the batch to the precision's dtype and moves it to the device before
    ``on_train_batch_start`` (``_TrainingEpochLoop.advance``, Lightning 2.x) and passes that
    same object to ``training_step``, so the in-place reordering reaches the model.

    Args:
        seed: seed of the permutations.

    Raises:
        RuntimeError: used with more than one process, or on a module without ``noise``.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._batch = 0
        self._perm: Optional[Tensor] = None
        self._inner: Optional[Callable[[Tensor], Tensor]] = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._batch = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.world_size != 1:
            raise RuntimeError(f"WithinBatchPermutation is a one-device probe; this run has world size "
                               f"{trainer.world_size}")
        if not callable(getattr(pl_module, "noise", None)):
            raise RuntimeError(f"{type(pl_module).__name__} has no `noise(mu)` to draw its noise through; "
                               "without it the noise could not follow its sample")
        n = len(batch[0])
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self._batch)
        self._perm = torch.randperm(n, generator=g)
        for t in batch:
            if isinstance(t, Tensor) and t.dim() > 0 and len(t) == n:
                t.copy_(t[self._perm.to(t.device)])
        self._inner = pl_module.noise
        pl_module.noise = self

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if pl_module.__dict__.get("noise") is self:  # not already restored by a callback before this one
            if getattr(self._inner, "__self__", None) is pl_module:
                del pl_module.noise  # it was the module's own method
            else:
                pl_module.noise = self._inner
        self._batch += 1

    def __call__(self, mu: Tensor) -> Tensor:
        """``eps`` for the permuted rows: the unpermuted ``noise(mu)[perm]``, ``mu: (B, latent_dim)``."""
        eps = self._inner(mu)
        return eps[self._perm.to(eps.device)]


def _final(result: tuple[dict, Path]) -> tuple[dict, dict]:
    """Final ``state_dict`` and last training record of one spec's result of
    [`launch_by_world_size`][vae_ddp.studies.launch.launch_by_world_size]."""
    run = result[0]["runs"][0]
    return torch.load(result[1] / run["params"])["state_dict"], run["records"][-1]


def _ratio(d: float, floor: float) -> Optional[float]:
    if floor > 0:
        return d / floor
    return 0.0 if d == 0 else None  # None: a difference over a zero floor (JSON has no infinity)


def _g(v: Optional[float]) -> str:
    """3 significant digits, scientific below 1e-3."""
    if v is None:
        return "inf"
    return "0" if v == 0 else (f"{v:.3g}" if abs(v) >= 1e-3 else f"{v:.2e}")


def verdict(ratio: Optional[float]) -> str:
    """The wording of one world size's result, from its ratio to the floor."""
    if ratio is None:
        return "differs where one device does not"
    if ratio <= FLOOR_FACTOR:
        return f"within {FLOOR_FACTOR:g}x of the one-device floor"
    return f"{ratio:.3g}x the one-device floor: more than reordering explains"


def _summary(result: dict) -> str:
    """One sentence over all world sizes, chosen from the ratios."""
    ws = result["world_sizes"]
    ok = [n for n, e in ws.items() if e["within_floor"]]
    head = f"{result['dtype']}, {result['optimizer']}: "
    if len(ok) == len(ws):
        worst = max((e["ratio_to_floor"] for e in ws.values()), default=0.0)
        return (head + f"DDP at world size {', '.join(ws)} matches one device: every difference is within "
                f"{FLOOR_FACTOR:g}x of the one-device reordering floor ({_g(result['floor'])}; largest ratio "
                f"{_g(worst)}).")
    bad = [n for n in ws if n not in ok]
    return (head + f"DDP at world size {', '.join(bad)} differs from one device by more than {FLOOR_FACTOR:g}x "
            f"the one-device reordering floor ({_g(result['floor'])}); see `worst_params` in equivalence.json.")


def equivalence(base: RunSpec, world_sizes: list[int], out_dir: Path, permutations: int = 4) -> dict:
    """Run the comparison; write and return ``out_dir/equivalence.json``::

        {"dtype", "optimizer", "steps", "model", "floor_factor",
         "floor": the largest max |theta_permuted - theta_single| of the permuted runs,
         "floor_runs": [that difference for each permuted run],
         "single": settings,
         "world_sizes": {N: {"max_abs_param_diff", "ratio_to_floor", "within_floor",
                             "max_abs_buffer_diff", "final_loss_diff", "verdict",
                             "worst_params": [{"name", "diff", "floor", "ratio"}, ...],
                             "settings"}},
         "summary": one sentence}

    Args:
        base: the run's settings (model, data, steps, global batch size, dtype, optimizer, seed);
            the fixes are all turned on here.
        world_sizes: DDP world sizes to compare with one device.
        out_dir: where the runs and ``equivalence.json`` go.
        permutations: one-device runs with the samples of each batch permuted; the floor is
            the largest of their differences from one device.

    ``permutations`` one-device runs each permute the samples inside every batch with their
    own seed ([`WithinBatchPermutation`][vae_ddp.studies.equivalence.WithinBatchPermutation]);
    the floor is the largest of their differences from ``single`` (one permutation is one
    draw of a rounding error that Adam amplifies unevenly; the largest of a few is a
    steadier yardstick). ``ratio_to_floor`` is ``max_abs_param_diff / floor`` (None if the
    floor is 0 and the difference is not); ``worst_params`` lists the 5 parameters with the
    largest difference, each with the floor of that parameter (largest over the permuted runs).

    Raises:
        UserError: ``permutations`` below 1.
    """
    if permutations < 1:
        raise UserError(f"--permutations must be at least 1 (the floor needs a permuted run), got {permutations}")
    out_dir = Path(out_dir)
    exact = dataclasses.replace(base, save_params=True, val_every=0, seeds=base.seeds[:1]).exact()
    single = dataclasses.replace(exact, config="single", label="single").validate()
    permuted = [dataclasses.replace(single, label=f"single, permuted {k}", permute_seed=k)
                for k in range(1, permutations + 1)]
    ddps = [dataclasses.replace(exact, config="ddp", devices=n, label=f"ddp-{n}").validate() for n in world_sizes]
    # one launch per world size: single and the permuted runs share one process
    launched = launch_by_world_size([single, *permuted, *ddps], out_dir / "runs")
    ref, ref_last = _final(launched[0])
    floor_by_param: dict[str, float] = {}
    floor_runs, rows = [], []
    for spec, run in zip(permuted, launched[1:]):
        perm, perm_last = _final(run)
        by_param = param_diffs(perm, ref)
        for k, v in by_param.items():
            floor_by_param[k] = max(v, floor_by_param.get(k, 0.0))
        floor_runs.append(max(by_param.values(), default=0.0))
        rows.append([f"1, samples permuted (seed {spec.permute_seed})", single.global_batch_size, _g(floor_runs[-1]),
                     "-", _g(max_abs_diff(perm, ref, buffers=True)), _g(abs(perm_last["loss"] - ref_last["loss"])),
                     "the floor" if len(permuted) == 1 else "one draw of the floor"])
    floor = max(floor_runs)
    result = {"dtype": base.dtype, "optimizer": base.optimizer, "steps": base.steps, "model": base.model,
              "floor_factor": FLOOR_FACTOR, "floor": floor, "floor_runs": floor_runs,
              "single": dataclasses.asdict(single), "world_sizes": {}}
    for spec, run in zip(ddps, launched[1 + len(permuted):]):
        params, last = _final(run)
        by_param = param_diffs(params, ref)
        d = max(by_param.values(), default=0.0)
        ratio = _ratio(d, floor)
        worst = sorted(by_param, key=by_param.get, reverse=True)[:5]
        entry = {"max_abs_param_diff": d, "ratio_to_floor": ratio,
                 "within_floor": ratio is not None and ratio <= FLOOR_FACTOR,
                 "max_abs_buffer_diff": max_abs_diff(params, ref, buffers=True),
                 "final_loss_diff": abs(last["loss"] - ref_last["loss"]), "verdict": verdict(ratio),
                 "worst_params": [{"name": k, "diff": by_param[k], "floor": floor_by_param[k],
                                   "ratio": _ratio(by_param[k], floor_by_param[k])} for k in worst],
                 "settings": dataclasses.asdict(spec)}
        result["world_sizes"][str(spec.devices)] = entry
        rows.append([spec.devices, spec.per_device_batch_size, _g(d), _g(ratio), _g(entry["max_abs_buffer_diff"]),
                     _g(entry["final_loss_diff"]), entry["verdict"]])
    result["summary"] = _summary(result)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "equivalence.json").write_text(json.dumps(result, indent=1))
    table = format_table(["world size", "per-device batch", "max abs param diff vs single", "ratio to floor",
                          "BatchNorm buffers", "final loss diff", "verdict"], rows,
                         title=f"{base.model} VAE, {base.data}, global batch {base.global_batch_size}, {base.steps} "
                               f"steps, {base.dtype}, {base.optimizer}, all fixes on")
    text = f"{result['summary']}\n\n{table}"
    print(text)
    write_tables(out_dir, text)
    return result
