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
from typing import Any, Optional

import torch
from pytorch_lightning import LightningModule, Trainer
from torch import Tensor

from vae_ddp.fixes.noise import GlobalBatchNoise
from vae_ddp.studies.configs import RunSpec
from vae_ddp.studies.launch import launch
from vae_ddp.studies.table import format_table

__all__ = ["equivalence", "max_abs_diff", "param_diffs", "WithinBatchPermutation", "FLOOR_FACTOR", "verdict"]

#: DDP matches one device when ``max |theta_ddp - theta_single|`` is at most this many
#: times the one-device reordering floor measured in the same run.
FLOOR_FACTOR = 2.0

#: Seed of the within-batch permutation of the floor run.
PERMUTE_SEED = 1


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


class WithinBatchPermutation(GlobalBatchNoise):
    """One device only: [`GlobalBatchNoise`][vae_ddp.fixes.noise.GlobalBatchNoise], with the
    samples of each training batch permuted and each noise row following its sample.

    At training batch k the callback draws ``perm = torch.randperm(B)`` from a generator
    seeded with ``permutation_seed * 1_000_003 + k`` and reorders, in place, every tensor
    of the batch whose first dimension is ``B`` (``x: (B, 3, 32, 32)``, the labels ``(B,)``):
    row ``i`` becomes row ``perm[i]``. The noise of that row is ``eps[perm[i]]``, where
    ``eps: (B, latent_dim)`` is what ``GlobalBatchNoise(seed)`` draws for the unpermuted
    batch. Every sample thus meets the same ``eps`` as in the unpermuted run, and the loss
    (a mean over the batch), its gradient and the BatchNorm statistics are the same sums in
    another order: only floating-point rounding can tell the two runs apart.

    Lightning converts the batch to the precision's dtype and moves it to the device before
    ``on_train_batch_start`` (``_TrainingEpochLoop.advance``, Lightning 2.x), and passes that
    same object to ``training_step``, so the in-place reordering reaches the model.

    Args:
        seed: the run's seed (as for ``GlobalBatchNoise``).
        permutation_seed: seed of the permutations.

    Raises:
        RuntimeError: used with more than one process.
    """

    def __init__(self, seed: int, permutation_seed: int) -> None:
        super().__init__(seed)
        self.permutation_seed = permutation_seed
        self._perm: Optional[Tensor] = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.world_size != 1:
            raise RuntimeError(f"WithinBatchPermutation is a one-device probe; this run has world size "
                               f"{trainer.world_size}")
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        n = len(batch[0])
        g = torch.Generator().manual_seed(self.permutation_seed * 1_000_003 + self._batch)
        self._perm = torch.randperm(n, generator=g)
        for t in batch:
            if isinstance(t, Tensor) and t.dim() > 0 and len(t) == n:
                t.copy_(t[self._perm.to(t.device)])

    def __call__(self, mu: Tensor) -> Tensor:
        """``eps`` for the permuted rows: ``GlobalBatchNoise``'s ``eps[perm]``, ``mu: (B, latent_dim)``."""
        eps = super().__call__(mu)
        return eps[self._perm.to(eps.device)] if self._perm is not None else eps


def _final(spec: RunSpec, out: Path) -> tuple[dict, dict]:
    run = launch(spec, out)["runs"][0]
    return torch.load(out / run["params"])["state_dict"], run["records"][-1]


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


def equivalence(base: RunSpec, world_sizes: list[int], out_dir: Path) -> dict:
    """Run the comparison; write and return ``out_dir/equivalence.json``::

        {"dtype", "optimizer", "steps", "model", "floor_factor",
         "floor": max |theta_permuted - theta_single|,
         "floor_settings": settings of the permuted one-device run,
         "single": settings,
         "world_sizes": {N: {"max_abs_param_diff", "ratio_to_floor", "within_floor",
                             "max_abs_buffer_diff", "final_loss_diff", "verdict",
                             "worst_params": [{"name", "diff", "floor", "ratio"}, ...],
                             "settings"}},
         "summary": one sentence}

    ``ratio_to_floor`` is ``max_abs_param_diff / floor`` (None if the floor is 0 and the
    difference is not); ``worst_params`` lists the 5 parameters with the largest
    difference, each with the permuted run's difference of that parameter.
    """
    out_dir = Path(out_dir)
    exact = dataclasses.replace(base, save_params=True, val_every=0, seeds=base.seeds[:1]).exact()
    single = dataclasses.replace(exact, config="single", label="single").validate()
    permuted = dataclasses.replace(single, label="single, permuted", permute_seed=PERMUTE_SEED)
    ddps = [dataclasses.replace(exact, config="ddp", devices=n, label=f"ddp-{n}").validate() for n in world_sizes]
    ref, ref_last = _final(single, out_dir / "runs" / "single")
    perm, perm_last = _final(permuted, out_dir / "runs" / "single-permuted")
    floor_by_param = param_diffs(perm, ref)
    floor = max(floor_by_param.values(), default=0.0)
    result = {"dtype": base.dtype, "optimizer": base.optimizer, "steps": base.steps, "model": base.model,
              "floor_factor": FLOOR_FACTOR, "floor": floor, "floor_settings": dataclasses.asdict(permuted),
              "single": dataclasses.asdict(single), "world_sizes": {}}
    rows = [[1, f"{single.global_batch_size} (samples permuted)", _g(floor), "1 (the floor)",
             _g(max_abs_diff(perm, ref, buffers=True)), _g(abs(perm_last["loss"] - ref_last["loss"])), "-"]]
    for spec in ddps:
        params, last = _final(spec, out_dir / "runs" / spec.label)
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
    print(format_table(["world size", "per-device batch", "max abs param diff vs single", "ratio to floor",
                        "BatchNorm buffers", "final loss diff", "verdict"], rows,
                       title=f"{base.model} VAE, {base.data}, global batch {base.global_batch_size}, {base.steps} "
                             f"steps, {base.dtype}, {base.optimizer}, all fixes on"))
    print()
    print(result["summary"])
    return result
