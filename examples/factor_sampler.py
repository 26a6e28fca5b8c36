"""Factor 3: sampler and data order. Does DDP step k see the samples of single-device step k?

Trains a few steps of ``single`` and of ``ddp`` (2 gloo processes) through Lightning with a
dataset that returns each sample's index, and records the global batch of every step
(rank 0's rows, then rank 1's): first with Lightning's defaults (a shuffled
``RandomSampler`` on one device, ``DistributedSampler`` under DDP), then with
[`GlobalBatchDistributedSampler`][vae_ddp.fixes.sampler.GlobalBatchDistributedSampler].

It also checks the index arithmetic of ``DistributedSampler`` against the recorded DDP
run: rank r takes ``perm[r::N]`` of one seeded permutation, so with equal per-rank batches
the ranks' batches at step k together are exactly batch k of a *one-replica*
``DistributedSampler`` with the same seed, but dealt interleaved: global position
``r * b + j`` holds ``perm[k*B + N*j + r]``, not ``perm[k*B + r*b + j]``. Per-sample noise
follows the position, so the interleaving matters for it. Finally it counts the repeated
samples ``DistributedSampler`` pads an epoch with.

    python examples/factor_sampler.py --out out/sampler
"""

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from matplotlib.figure import Figure
from torch.utils.data import DistributedSampler

from vae_ddp.data import DigitsDataModule
from vae_ddp.fixes import registry
from vae_ddp.harness.configs import RunSpec
from vae_ddp.harness.launch import launch_by_world_size

COMPARISONS = (  # what one device uses against DDP's sampler
    ("default", "one device: `RandomSampler` (Lightning's default); DDP: `DistributedSampler` (default)"),
    ("one_replica", "one device: `DistributedSampler(num_replicas=1)`, same seed; DDP: `DistributedSampler` (default)"),
    ("global", "`GlobalBatchDistributedSampler` on both"),
)


def step_batches(specs: list[RunSpec], tmp: Path) -> list[list[list[int]]]:
    """Per spec: the dataset indices of each optimizer step's global batch (rank 0's rows, then
    rank 1's, ...); one launch per world size."""
    launched = launch_by_world_size([s.validate() for s in specs], tmp, quiet=True)
    return [[r["indices"] for r in result["runs"][0]["records"]] for result, _ in launched]


def compare(one: list[list[int]], ddp: list[list[int]]) -> dict:
    """Per step: the fraction of the global batch both runs contain, and of the rows holding the same sample."""
    return {"same_samples": [len(set(s) & set(d)) / len(s) for s, d in zip(one, ddp)],
            "same_position": [sum(a == b for a, b in zip(s, d)) / len(s) for s, d in zip(one, ddp)]}


def takeaway(r: dict) -> str:
    """The result in one sentence, worded from the numbers."""
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    d, o, g = (r["comparisons"][k] for k in ("default", "one_replica", "global"))
    union = "are exactly" if min(o["same_samples"]) == 1.0 else f"share {100 * mean(o['same_samples']):.3g}% with"
    fixed = ("the same samples in the same rows" if min(g["same_position"]) == 1.0
             else f"{100 * mean(g['same_position']):.3g}% of the rows alike")
    return (f"**Result.** With Lightning's defaults, DDP's step k shares only {100 * mean(d['same_samples']):.3g}% "
            f"of its samples with one device's step k, on average over the {len(d['same_samples'])} steps (the table "
            f"gives each step): one device shuffles with a `RandomSampler`, DDP with a "
            f"`DistributedSampler` of its own permutation. The ranks' batches together {union} the batch k of a "
            f"one-replica `DistributedSampler` with the same seed, but dealt interleaved: only "
            f"{100 * mean(o['same_position']):.3g}% of the rows hold the same sample, and so get the same per-sample "
            f"noise. `GlobalBatchDistributedSampler` gives {fixed}.")


def plot(r: dict, path: Path) -> None:
    fig = Figure(figsize=(7.5, 3.4), layout="constrained")
    ax = fig.subplots()
    width = 0.38
    for i, (key, label) in enumerate((("same_samples", "same samples in the step"),
                                      ("same_position", "same sample in the same row"))):
        ys = [100 * sum(r["comparisons"][c][key]) / r["steps"] for c, _ in COMPARISONS]
        ax.bar([x + (i - 0.5) * width for x in range(len(COMPARISONS))], ys, width, label=label, color=f"C{i}")
    ax.set_xticks(range(len(COMPARISONS)), ["RandomSampler", "DistributedSampler\n(1 replica)",
                                           "GlobalBatch-\nDistributedSampler"])
    ax.set_xlabel("what one device uses (DDP: its default DistributedSampler; last: the fix on both)")
    ax.set_ylabel("% of the global batch\n(mean over steps)")
    ax.set_ylim(0, 105)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="data order and sampling under DDP")
    p.add_argument("--out", type=Path, default=Path("out/sampler"))
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args(argv)
    gb, world, seed = 64, 2, 0
    base = RunSpec(steps=args.steps, global_batch_size=gb, devices=world, record_indices=True, latent_dim=8,
                   seeds=[seed])
    result = {"global_batch_size": gb, "world_size": world, "steps": args.steps, "comparisons": {}}
    keys = [(config, sampler) for sampler in ("default", "global") for config in ("single", "ddp")]
    with tempfile.TemporaryDirectory() as tmp:
        specs = [dataclasses.replace(base, config=c, sampler=s, label=f"{c}, {s}") for c, s in keys]
        runs = dict(zip(keys, step_batches(specs, Path(tmp))))
    dm = DigitsDataModule()
    dm.setup()
    # --8<-- [start:one-replica]
    # One device with a one-replica DistributedSampler seeded like Lightning's (PL_GLOBAL_SEED = seed):
    positions = DistributedSampler(dm.dataset_train, num_replicas=1, rank=0, shuffle=True, seed=seed)
    one = [dm.dataset_train.indices[i] for i in positions]  # dataset_train is a random_split Subset: its
    #                                                          samples report their index in the full set
    one_replica = [one[k * gb:(k + 1) * gb] for k in range(args.steps)]
    # --8<-- [end:one-replica]
    result["comparisons"]["default"] = compare(runs["single", "default"], runs["ddp", "default"])
    result["comparisons"]["one_replica"] = compare(one_replica, runs["ddp", "default"])
    result["comparisons"]["global"] = compare(runs["single", "global"], runs["ddp", "global"])
    # the interleaving predicted by the index arithmetic: position r*b + j holds perm[k*B + N*j + r]
    b = gb // world
    predicted = [[one[k * gb + world * j + r] for r in range(world) for j in range(b)] for k in range(args.steps)]
    result["interleaving_predicted_exactly"] = predicted == runs["ddp", "default"]
    n = len(dm.dataset_train)
    result["padding"] = {str(w): DistributedSampler(dm.dataset_train, num_replicas=w, rank=0).total_size - n
                         for w in (2, 3, 4, 8)}
    result["train_size"] = n
    d, g = result["comparisons"]["default"], result["comparisons"]["global"]
    result["summary"] = {
        "Factor": registry.get("sampler").name,  # the factor's one name (vae_ddp.fixes.registry)
        "What goes wrong": "one device shuffles with RandomSampler, DDP with DistributedSampler, dealt interleaved",
        "Measured here": f"{100 * sum(d['same_samples']) / args.steps:.3g}% of a step's samples in common with one "
                         f"device's step; {100 * min(g['same_position']):.3g}% (same rows) with the fix",
        "Fix": "the same sampler on one device and on N; `GlobalBatchDistributedSampler` and "
               "`use_distributed_sampler=False`",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "factor_sampler.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "factor_sampler.png")
    print(takeaway(result) + "\n")
    print(f"DDP ({world} ranks x {b}) against one device ({gb}), per optimizer step:\n")
    print("| samplers | same samples in the step | same sample in the same row |")  # three columns: fits a phone
    print("|---|---|---|")
    for key, label in COMPARISONS:
        c = result["comparisons"][key]
        pct = lambda xs: ", ".join(f"{100 * x:.3g}%" for x in xs)  # noqa: E731
        print(f"| {label} | {pct(c['same_samples'])} | {pct(c['same_position'])} |")
    print(f"\nThe DDP rows are where the index arithmetic puts them (rank r, row j: `perm[k*B + N*j + r]`): "
          f"{'yes, at every step' if result['interleaving_predicted_exactly'] else 'no'}.")
    pads = ", ".join(f"{w} ranks: {k}" for w, k in result["padding"].items())
    print(f"\n`DistributedSampler` pads each epoch of the {n} training images with repeated samples: {pads}.")
    return result


if __name__ == "__main__":
    main()
