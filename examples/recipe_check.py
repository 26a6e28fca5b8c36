"""The check of the recipe (``examples/recipe.py``): does DDP at world sizes 2, 3 and 4 reach one device?

``--check`` trains, in float64 and float32: one device, which records its weights at every
step; one device again with the samples of each batch permuted (the same loss summed in
another order: the rounding floor), both in this process; and, in one DDP launch per world
size (gloo processes), the recipe's plain changes (``train`` of ``examples/recipe.py``) and
``vae_ddp``'s helpers. Every run but the first starts each step from one device's weights at
that step, and its gradient (after DDP's all-reduce) is compared with one device's.
``--changes`` prints the table of changes. Lightning starts the other DDP ranks by re-running
the command line (``--ddp``), and the four DDP runs of a world size (two dtypes, plain and
helpers) train one after the other in the same processes.

    python examples/recipe_check.py --check --out out/recipe
    python examples/recipe_check.py --check --world-sizes 2 --steps 6 --out out/recipe
    python examples/recipe_check.py --changes
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from recipe import GLOBAL_BATCH_SIZE, Digits, train  # examples/recipe.py, beside this file
from vae_ddp.fixes import GlobalBatchDistributedSampler, GlobalBatchNoise, registry


# --8<-- [start:helpers]
class DigitsGlobalBatches(Digits):
    """Change 3 with vae_ddp's sampler: each global batch dealt to the ranks in contiguous chunks."""

    def sampler(self, ds, world, rank):
        return GlobalBatchDistributedSampler(ds, self.global_batch_size, num_replicas=world, rank=rank, seed=self.seed)


# Change 4 with vae_ddp's callback: Trainer(callbacks=[GlobalBatchNoise(seed)]) replaces
# model.noise during each training batch by the global batch's noise, sliced in the same
# contiguous chunks (the module keeps drawing through self.noise(mu)).
# --8<-- [end:helpers]


#: The precisions the check compares in.
DTYPES = ("float64", "float32")

#: The recipe as data: (change number or None, factor key, plain Lightning/torch, vae_ddp helper).
#: The numbers are those of the ``# change N`` comments above (a test checks that they agree);
#: each factor's name and page come from ``vae_ddp.fixes.registry``.
CHANGES = [
    (1, "batchnorm", "`Trainer(sync_batchnorm=True)` (GPUs)",
     "`Trainer(plugins=[GlobalSyncBatchNorm()])` (CPU/gloo, where SyncBatchNorm refuses)"),
    (2, "logging", "`self.log(..., sync_dist=True, batch_size=len(batch[0]))`", "-"),
    (3, "sampler", "`DistributedSampler(ds, num_replicas=world_size, rank=rank, seed=seed, "
     "drop_last=True)` at every world size, 1 included; `Trainer(use_distributed_sampler=False)`",
     "`GlobalBatchDistributedSampler(ds, global_batch_size)`"),
    (3, "reduction", "equal per-rank batches: `DataLoader(batch_size=global_batch_size // world_size, "
     "drop_last=True)`", "`GlobalBatchDistributedSampler` drops the incomplete global batch"),
    (4, "noise", "draw `eps` for the global batch from a `torch.Generator` seeded per step, keep "
     "this rank's rows (`noise` above)", "`Trainer(callbacks=[GlobalBatchNoise(seed)])`, noise drawn through "
     "`self.noise(mu)`; `PerRankSeed(seed)` for independent (not identical) noise per rank"),
    (None, "optimizer", "none of its own: given the same gradients, Adam takes the same steps", "-"),
]


def changes_table() -> str:
    """The recipe table in Markdown, headed by counts taken from ``CHANGES``."""
    numbers = sorted({c[0] for c in CHANGES if c[0] is not None})
    notes = []
    for n in numbers:
        factors = [f"*{registry.get(c[1]).name}*" for c in CHANGES if c[0] == n]
        if len(factors) > 1:
            notes.append(f"change {n} serves both {' and '.join(factors)}" if len(factors) == 2
                         else f"change {n} serves {', '.join(factors)}")
    notes += [f"*{registry.get(c[1]).name}* needs none" for c in CHANGES if c[0] is None]
    head = f"{len(numbers)} changes cover the {len(CHANGES)} factors" + (f" ({'; '.join(notes)})" if notes else "")
    lines = [head + ":", "", "| Change | Factor | Plain Lightning / torch | `vae_ddp` helper |", "|---|---|---|---|"]
    for n, key, plain, helper in CHANGES:
        factor = registry.get(key)
        lines.append(f"| {n or '-'} | [{factor.name}]({factor.page}) | {plain} | {helper} |")
    return "\n".join(lines)


def check_one(dtype: str, steps: int, seed: int, permutations: int, out: Path) -> None:
    """One device: the reference run, which records its weights and gradient at every step
    (``single-steps.pt``), and the permuted runs (the floor), each started at every step from
    the reference's weights (``single-permuted-K.pt``: their gradients)."""
    from vae_ddp.probes import StepProbe
    from vae_ddp.harness.permutation import WithinBatchPermutation

    reference = StepProbe(record_states=True)
    train(1, dtype, steps, seed, callbacks=[reference])
    torch.save({"states": reference.states, "grads": reference.grads}, out / "single-steps.pt")
    for k in range(1, permutations + 1):
        probe = StepProbe(reference.states)
        train(1, dtype, steps, seed, callbacks=[probe, WithinBatchPermutation(k)])
        torch.save({"grads": probe.grads}, out / f"single-permuted-{k}.pt")


def check_ddp(devices: int, steps: int, seed: int, out: Path) -> None:
    """DDP on ``devices`` processes, plain changes and helpers, in each dtype, every step started
    from the weights one device recorded (``out/DTYPE/single-steps.pt``); rank 0 saves each run's
    gradients (``out/DTYPE/ddp-N-plain.pt``, ``ddp-N-helpers.pt``)."""
    from vae_ddp.probes import StepProbe

    for dtype in DTYPES:
        states = torch.load(out / dtype / "single-steps.pt")["states"]
        for variant in ("plain", "helpers"):
            probe = StepProbe(states)  # first: the step starts from θ_k
            helpers = {"callbacks": [probe, GlobalBatchNoise(seed)], "data_class": DigitsGlobalBatches} \
                if variant == "helpers" else {"callbacks": [probe]}
            trainer, _ = train(devices, dtype, steps, seed, **helpers)
            if trainer.is_global_zero:
                torch.save({"grads": probe.grads}, out / dtype / f"ddp-{devices}-{variant}.pt")


def check(steps: int, seed: int, permutations: int, out: Path, world_sizes: tuple[int, ...] = (2, 3, 4)) -> dict:
    """Single, permuted single and DDP at each of ``world_sizes`` (plain, helpers) in float64 and
    float32, every step started from one device's weights: the table. The tensors the runs saved
    are deleted once compared (``recipe.json`` keeps the numbers)."""
    from vae_ddp.probes import per_step_differences
    from vae_ddp.harness.permutation import FLOOR_FACTOR
    from vae_ddp.studies.equivalence import verdict
    from vae_ddp.outputs import drop_tensors

    result = {"method": "teacher-forced", "floor_factor": FLOOR_FACTOR, "steps": steps, "permutations": permutations,
              "global_batch_size": GLOBAL_BATCH_SIZE, "world_sizes": list(world_sizes), "dtypes": {}}
    rows = []
    for dtype in DTYPES:
        (out / dtype).mkdir(parents=True, exist_ok=True)
        check_one(dtype, steps, seed, permutations, out / dtype)
    for n in world_sizes:  # one launch per world size
        subprocess.run([sys.executable, __file__, "--ddp", str(n), "--steps", str(steps), "--seed", str(seed),
                        "--save", str(out)], check=True)
    for dtype in DTYPES:
        d = out / dtype
        ref = torch.load(d / "single-steps.pt")["grads"]
        floor_steps = [per_step_differences(torch.load(d / f"single-permuted-{k}.pt")["grads"], ref)
                       for k in range(1, permutations + 1)]
        floor_runs = [max(f) for f in floor_steps]
        floor = max(floor_runs)
        entry = {"floor": floor, "floor_runs": floor_runs, "floor_steps": floor_steps, "ddp": {}}
        for n in world_sizes:
            entry["ddp"][str(n)] = {}
            for variant in ("plain", "helpers"):
                steps_diff = per_step_differences(torch.load(d / f"ddp-{n}-{variant}.pt")["grads"], ref)
                diff = max(steps_diff)
                ratio = diff / floor if floor > 0 else (0.0 if diff == 0 else None)
                entry["ddp"][str(n)][variant] = {
                    "max_grad_diff": diff, "grad_steps": steps_diff, "ratio_to_floor": ratio,
                    "within_floor": ratio is not None and ratio <= FLOOR_FACTOR, "verdict": verdict(ratio)}
                rows.append((dtype, n, "plain Lightning/torch" if variant == "plain" else "vae_ddp helpers",
                             diff, floor, ratio, verdict(ratio)))
        result["dtypes"][dtype] = entry
    drop_tensors(out)  # the numbers are in recipe.json
    (out / "recipe.json").write_text(json.dumps(result, indent=1))
    fmt = lambda v: "inf" if v is None else ("0" if v == 0 else f"{v:.3g}" if abs(v) >= 1e-3 else f"{v:.2e}")  # noqa: E731
    print(f"BottleneckClassifier on digits, global batch {GLOBAL_BATCH_SIZE}, {steps} Adam steps, each started "
          f"from one device's weights: the gradient's largest relative difference to one device's over the steps\n")
    print("| dtype | world size | verdict | changes | gradient difference | floor | ratio |")
    print("|---|---|---|---|---|---|---|")
    for dtype, n, run, diff, floor, ratio, text in rows:
        print(f"| {dtype} | {n} | {text} | {run} | {fmt(diff)} | {fmt(floor)} | {fmt(ratio)} |")
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description="the check of the recipe: DDP against one device and its floor")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="compare DDP with one device and the floor")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4], help="DDP world sizes to check")
    p.add_argument("--changes", action="store_true", help="print the table of changes")
    p.add_argument("--permutations", type=int, default=4, help="permuted one-device runs for the floor")
    p.add_argument("--ddp", type=int, default=None, metavar="N",
                   help="(internal) the DDP runs of --check, on N processes")
    p.add_argument("--save", type=Path, default=None, help="(internal) the folder of --check's runs")
    p.add_argument("--out", type=Path, default=Path("out/recipe"))
    args = p.parse_args(argv)
    from vae_ddp.utils import quiet

    quiet()
    bad = [n for n in args.world_sizes if n < 2 or GLOBAL_BATCH_SIZE % n]
    if bad:
        p.error(f"--world-sizes {bad[0]}: a DDP world size from 2 that divides the global batch {GLOBAL_BATCH_SIZE}")
    if args.changes:
        print(changes_table())
    elif args.check:
        args.out.mkdir(parents=True, exist_ok=True)
        check(args.steps, args.seed, args.permutations, args.out, tuple(args.world_sizes))
    elif args.ddp and args.save is not None:
        from vae_ddp.utils import close_process_group

        check_ddp(args.ddp, args.steps, args.seed, args.save)
        close_process_group()  # Lightning leaves gloo's threads alive: at exit they may abort the process
    else:
        p.error("give --check or --changes")


if __name__ == "__main__":
    main()
