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
from torch.utils.data import DistributedSampler

from vae_ddp.studies.configs import RunSpec
from vae_ddp.data import DigitsDataModule
from vae_ddp.studies.launch import launch
from vae_ddp.model import VAE

METRICS = ("loss", "kl", "recon_loss")


def logged_vs_global(spec: RunSpec, out: Path) -> dict:
    records = launch(spec.validate(), out, quiet=True)["runs"][0]["records"]
    res = {}
    for m in METRICS:
        diffs = [abs(r[f"logged_{m}"] - r[m]) for r in records]
        steps = [abs(b[m] - a[m]) for a, b in zip(records, records[1:])]
        res[m] = {"mean_abs_diff": statistics.fmean(diffs), "max_abs_diff": max(diffs),
                  "mean_abs_step_change": statistics.fmean(steps)}
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


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="what Lightning logs under DDP")
    p.add_argument("--out", type=Path, default=Path("out/logging"))
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    base = RunSpec(config="ddp", devices=2, steps=args.steps, global_batch_size=64, latent_dim=16, lr=1e-3)
    result = {"steps": args.steps, "global_batch_size": 64, "world_size": 2}
    with tempfile.TemporaryDirectory() as tmp:
        result["default"] = logged_vs_global(base, Path(tmp) / "default")
        result["sync_dist"] = logged_vs_global(dataclasses.replace(base, sync_dist_logging=True), Path(tmp) / "sync")
    result["validation"] = validation_share()
    d, s = result["default"]["loss"], result["sync_dist"]["loss"]
    result["summary"] = {
        "Factor": "Logging",
        "What goes wrong": "`self.log` without `sync_dist` plots rank 0's half batch, not the global batch",
        "Measured here": f"logged loss off by {d['mean_abs_diff']:.1e} on average (a step changes it by "
                         f"{d['mean_abs_step_change']:.1e}); {s['max_abs_diff']:.0e} with the fix",
        "Fix": "`self.log(..., sync_dist=True)`",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "factor_logging.json").write_text(json.dumps(result, indent=1))
    print(f"ddp, 2 ranks x 32, {args.steps} steps: logged value on rank 0 vs the global-batch value\n")
    print("| logging | metric | mean abs diff | max abs diff | mean change per step (for scale) |")
    print("|---|---|---|---|---|")
    for mode, label in (("default", "`self.log(...)`"), ("sync_dist", "`self.log(..., sync_dist=True)`")):
        for m in METRICS:
            r = result[mode][m]
            print(f"| {label} | {m} | {r['mean_abs_diff']:.2e} | {r['max_abs_diff']:.2e} | "
                  f"{r['mean_abs_step_change']:.2e} |")
    v = result["validation"]
    print(f"\nvalidation loss over rank 0's share ({v['rank0_share']} of {v['val_size']} images): "
          f"{v['loss_rank0']:.5f}; over the whole set: {v['loss_all']:.5f}")
    return result


if __name__ == "__main__":
    main()
