"""Factor 5: logging. Is the logged DDP curve the curve of the global batch?

``self.log(..., on_step=True)`` without ``sync_dist=True`` logs rank 0's value: the mean
over its own ``B/N`` samples, not over the global batch. This script trains ``ddp`` (2 gloo
processes) through Lightning and records per step both what Lightning logged on rank 0
and the loss over the whole global batch, without and with ``sync_dist=True``; the
training itself is identical, only the logged curve moves. It also measures what an
epoch-level validation metric is on rank 0's share of the validation set
(``DistributedSampler(shuffle=False)``, padded) against the whole set.

    python examples/factor_logging.py --out out/logging
"""

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

import torch
from matplotlib.figure import Figure
from torch.utils.data import DistributedSampler

from vae_ddp.data import DigitsDataModule
from vae_ddp.fixes import registry
from vae_ddp.model import VAE
from vae_ddp.harness.configs import RunSpec
from vae_ddp.harness.launch import launch_by_world_size

METRICS = ("kl", "recon_loss", "loss")
MODES = (("default", "`self.log(...)`"), ("sync_dist", "`self.log(..., sync_dist=True)`"))


def logged_vs_global(records: list[dict]) -> dict:
    """Per metric: |logged on rank 0 - global batch| (mean, max) and the per-step curves."""
    res = {}
    for m in METRICS:
        diffs = [abs(r[f"logged_{m}"] - r[m]) for r in records]
        steps = [abs(b[m] - a[m]) for a, b in zip(records, records[1:])]
        res[m] = {"mean_abs_diff": statistics.fmean(diffs), "max_abs_diff": max(diffs),
                  "mean_abs_step_change": statistics.fmean(steps),
                  "mean_value": statistics.fmean(abs(r[m]) for r in records),
                  "logged": [r[f"logged_{m}"] for r in records], "global": [r[m] for r in records]}
    return res


@torch.no_grad()
def validation_share(world_size: int = 2) -> dict:
    """Mean val loss (eps = 0, eval mode) over rank 0's DistributedSampler share vs the whole set."""
    torch.manual_seed(0)
    dm = DigitsDataModule()
    dm.setup()
    model = VAE(enc_type="small", latent_dim=16).eval()
    x = torch.stack([dm.dataset_val[i][0] for i in range(len(dm.dataset_val))])
    losses = torch.stack([model.step(x[i:i + 1], torch.zeros(1, 16))[0] for i in range(len(x))])
    share = list(DistributedSampler(dm.dataset_val, num_replicas=world_size, rank=0, shuffle=False))
    return {"val_size": len(x), "rank0_share": len(share), "loss_all": float(losses.mean()),
            "loss_rank0": float(losses[share].mean())}


def takeaway(r: dict) -> str:
    """The result in one sentence, worded from the numbers."""
    d, s = r["default"]["kl"], r["sync_dist"]["kl"]
    ratio = d["mean_abs_diff"] / d["mean_abs_step_change"]
    scale = ("larger than" if ratio > 1.1 else "smaller than" if ratio < 0.9 else "about as large as")
    fixed = "float32 rounding" if s["max_abs_diff"] < 1e-6 else f"{s['mean_abs_diff']:.2e}"
    return (f"**Result.** By default the logged KL term is rank 0's half batch: it differs from the KL of the "
            f"global batch by {d['mean_abs_diff']:.2e} on average ({100 * d['mean_abs_diff'] / d['mean_value']:.3g}% "
            f"of the KL), {scale} the change of the KL from one step to the next ({d['mean_abs_step_change']:.2e}). "
            f"With `sync_dist=True` the logged value is the global-batch value up to {fixed}; the training is the "
            f"same in both runs.")


def plot(r: dict, path: Path) -> None:
    fig = Figure(figsize=(9, 3.2), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, (mode, label) in zip(axes, MODES):
        c = r[mode]["kl"]
        steps = range(1, len(c["global"]) + 1)
        ax.plot(steps, c["global"], color="k", lw=2, label="global batch (what one device logs)")
        ax.plot(steps, c["logged"], "o--", color="C3", ms=3, lw=1, label="logged by Lightning on rank 0")
        ax.set_title(label.strip("`"), fontsize=9)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("KL term (x kl_coeff)")  # every panel labelled, shared axis or not
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="what Lightning logs under DDP")
    p.add_argument("--out", type=Path, default=Path("out/logging"))
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    base = RunSpec(config="ddp", devices=2, steps=args.steps, global_batch_size=64, latent_dim=16, lr=1e-3)
    result = {"steps": args.steps, "global_batch_size": 64, "world_size": 2}
    specs = [base.validate(), dataclasses.replace(base, sync_dist_logging=True).validate()]
    with tempfile.TemporaryDirectory() as tmp:  # both runs in one launch
        default, synced = (run["runs"][0]["records"] for run, _ in launch_by_world_size(specs, Path(tmp), quiet=True))
    result["default"], result["sync_dist"] = logged_vs_global(default), logged_vs_global(synced)
    result["validation"] = validation_share()
    d, s = result["default"]["kl"], result["sync_dist"]["kl"]
    result["summary"] = {
        "Factor": registry.get("logging").name,  # the factor's one name (vae_ddp.fixes.registry)
        "What goes wrong": "`self.log` without `sync_dist` plots rank 0's half batch, not the global batch",
        "Measured here": f"logged KL off by {d['mean_abs_diff']:.2e} on average (a step changes it by "
                         f"{d['mean_abs_step_change']:.2e} on average); {s['mean_abs_diff']:.2e} on average "
                         "with the fix",
        "Fix": "`self.log(..., sync_dist=True, batch_size=len(batch[0]))`",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "factor_logging.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "factor_logging.png")
    print(takeaway(result) + "\n")
    print(f"ddp, 2 ranks x 32, {args.steps} steps: logged value on rank 0 vs the global-batch value\n")
    # three columns, two numbers in one: fits a phone
    print("| logging, metric | abs diff: mean / max | mean change per step (for scale) |")
    print("|---|---|---|")
    for mode, label in MODES:
        for m in METRICS:
            r = result[mode][m]
            print(f"| {label}: {m} | {r['mean_abs_diff']:.2e} / {r['max_abs_diff']:.2e} | "
                  f"{r['mean_abs_step_change']:.2e} |")
    v = result["validation"]
    print(f"\nvalidation loss over rank 0's share ({v['rank0_share']} of {v['val_size']} images): "
          f"{v['loss_rank0']:.5f}; over the whole set: {v['loss_all']:.5f}")
    return result


if __name__ == "__main__":
    main()
