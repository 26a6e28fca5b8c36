"""The recipe on your own LightningModule: DDP that computes what one device computes.

``BottleneckClassifier`` stands for your module. It is not this site's VAE, but it has
what the factors act on: BatchNorm, a reparameterized Gaussian layer (a variational
information bottleneck, Alemi et al. 2017, arXiv:1612.00410), a mean loss and logged
metrics; batches are ``(x, y)`` from scikit-learn's bundled digits (no download). The
lines marked ``# change N`` are the recipe in plain Lightning/torch; ``--helpers`` makes
the same changes with ``vae_ddp.fixes`` instead.

    python examples/recipe.py --devices 2 --out out/recipe     # one training run
    python examples/recipe.py --check --out out/recipe         # the check shown on the page

``--check`` trains one device; one device again with the samples of each batch permuted
(the same loss summed in another order: the rounding floor); and DDP on 2 gloo
processes with the plain changes and with the helpers, in float64 and float32, and
compares the final parameters. Lightning starts the other DDP rank by re-running the
command line, so every run is its own process.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from vae_ddp.fixes import GlobalBatchDistributedSampler, GlobalBatchNoise, GlobalSyncBatchNorm, registry


# --8<-- [start:module]
class BottleneckClassifier(pl.LightningModule):
    """Digits classifier ``x: (B, 64) -> logits (B, 10)`` through a Gaussian bottleneck ``z: (B, 16)``."""

    def __init__(self, seed: int = 0, lr: float = 1e-3, beta: float = 1e-2):
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(nn.Linear(64, 128, bias=False), nn.BatchNorm1d(128), nn.ReLU())
        self.fc_mu, self.fc_log_var = nn.Linear(128, 16), nn.Linear(128, 16)
        self.head = nn.Linear(16, 10)

    def noise(self, mu):  # change 4: one generator per global batch, this rank's rows of it
        g = torch.Generator(mu.device).manual_seed(self.hparams.seed * 1_000_003 + self.global_step)
        world, rank = self.trainer.world_size, self.global_rank
        eps = torch.randn((world * len(mu), *mu.shape[1:]), generator=g, dtype=mu.dtype, device=mu.device)
        return eps[rank::world]  # DistributedSampler deals the rows of a global batch round-robin

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.body(x)
        mu, log_var = self.fc_mu(h), self.fc_log_var(h)
        z = mu + torch.exp(0.5 * log_var) * self.noise(mu)  # reparameterization trick
        ce = F.cross_entropy(self.head(z), y)
        kl = 0.5 * (mu.pow(2) + log_var.exp() - 1 - log_var).sum(1).mean()
        self.log_dict({"train_ce": ce, "train_kl": kl},
                      sync_dist=True, batch_size=len(x))  # change 2: mean over the global batch
        return ce + self.hparams.beta * kl

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class Digits(pl.LightningDataModule):
    """scikit-learn's 1,797 digits, ``x: (64,)`` floats in [0, 1], ``y`` the class."""

    def __init__(self, global_batch_size: int = 64, seed: int = 0):
        super().__init__()
        self.global_batch_size, self.seed = global_batch_size, seed

    def train_dataloader(self):
        from sklearn.datasets import load_digits

        d = load_digits()
        ds = TensorDataset(torch.tensor(d.data / 16, dtype=torch.float32), torch.tensor(d.target))
        world, rank = self.trainer.world_size, self.trainer.global_rank
        return DataLoader(ds, batch_size=self.global_batch_size // world, sampler=self.sampler(ds, world, rank),
                          drop_last=True)  # change 3: equal per-rank batches

    def sampler(self, ds, world, rank):  # change 3: the same global batches at any world size
        return DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=self.seed, drop_last=True)
# --8<-- [end:module]


# --8<-- [start:helpers]
class DigitsGlobalBatches(Digits):
    """Change 3 with vae_ddp's sampler: each global batch dealt to the ranks in contiguous chunks."""

    def sampler(self, ds, world, rank):
        return GlobalBatchDistributedSampler(ds, self.global_batch_size, num_replicas=world, rank=rank, seed=self.seed)


# Change 4 with vae_ddp's callback: Trainer(callbacks=[GlobalBatchNoise(seed)]) replaces
# model.noise during each training batch by the global batch's noise, sliced in the same
# contiguous chunks (the module keeps drawing through self.noise(mu)).
# --8<-- [end:helpers]


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


def train(devices: int, dtype: str, steps: int, seed: int, helpers: bool = False, callbacks=()):
    """Train one run; return the Trainer and the module (rank 0 reads the result)."""
    # --8<-- [start:fixes]
    pl.seed_everything(seed)
    model = BottleneckClassifier(seed=seed)
    data = Digits(global_batch_size=64, seed=seed)
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if accelerator == "gpu":
        sync_bn = {"sync_batchnorm": True}  # change 1: BatchNorm statistics of the global batch
    else:
        sync_bn = {"plugins": [GlobalSyncBatchNorm()]}  # change 1 on CPU/gloo (SyncBatchNorm needs CUDA)
    trainer = pl.Trainer(accelerator=accelerator, devices=devices, strategy="ddp" if devices > 1 else "auto",
                         use_distributed_sampler=False,  # change 3: keep the sampler above
                         precision="64-true" if dtype == "float64" else "32-true", max_steps=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, **sync_bn)
    # --8<-- [end:fixes]
    if helpers:
        data = DigitsGlobalBatches(global_batch_size=64, seed=seed)
        trainer.callbacks.append(GlobalBatchNoise(seed))
    trainer.callbacks.extend(callbacks)
    trainer.fit(model, datamodule=data)
    return trainer, model


def check_one(dtype: str, steps: int, seed: int, permutations: int, out: Path) -> None:
    """One device: the reference run and the permuted runs (the floor), saved to ``out``."""
    from vae_ddp.studies.equivalence import WithinBatchPermutation

    for k in range(permutations + 1):
        _, model = train(1, dtype, steps, seed, callbacks=[WithinBatchPermutation(k)] if k else [])
        torch.save(model.state_dict(), out / (f"single-permuted-{k}.pt" if k else "single.pt"))


def check(steps: int, seed: int, permutations: int, out: Path) -> dict:
    """Single, permuted single and DDP on 2 (plain, helpers) in float64 and float32: the table."""
    from vae_ddp.studies.equivalence import FLOOR_FACTOR, max_abs_diff, verdict

    result = {"floor_factor": FLOOR_FACTOR, "steps": steps, "permutations": permutations, "dtypes": {}}
    rows = []
    for dtype in ("float64", "float32"):
        d = out / dtype
        d.mkdir(parents=True, exist_ok=True)
        base = [sys.executable, __file__, "--dtype", dtype, "--steps", str(steps), "--seed", str(seed)]
        subprocess.run([*base, "--devices", "1", "--permutations", str(permutations), "--save", str(d)], check=True)
        for variant, flag in (("plain", []), ("helpers", ["--helpers"])):
            subprocess.run([*base, "--devices", "2", *flag, "--save", str(d / f"ddp-{variant}.pt")], check=True)
        single = torch.load(d / "single.pt")
        floors = [max_abs_diff(torch.load(d / f"single-permuted-{k}.pt"), single) for k in range(1, permutations + 1)]
        floor = max(floors)
        entry = {"floor": floor, "floor_runs": floors, "ddp": {}}
        for variant in ("plain", "helpers"):
            diff = max_abs_diff(torch.load(d / f"ddp-{variant}.pt"), single)
            ratio = diff / floor if floor > 0 else (0.0 if diff == 0 else None)
            entry["ddp"][variant] = {"max_abs_param_diff": diff, "ratio_to_floor": ratio,
                                     "within_floor": ratio is not None and ratio <= FLOOR_FACTOR,
                                     "verdict": verdict(ratio)}
            rows.append((dtype, f"DDP on 2, {'plain Lightning/torch' if variant == 'plain' else 'vae_ddp helpers'}",
                         diff, floor, ratio, verdict(ratio)))
        result["dtypes"][dtype] = entry
    (out / "recipe.json").write_text(json.dumps(result, indent=1))
    fmt = lambda v: "inf" if v is None else ("0" if v == 0 else f"{v:.3g}" if abs(v) >= 1e-3 else f"{v:.2e}")  # noqa: E731
    print(f"BottleneckClassifier on digits, global batch 64, {steps} Adam steps: final parameters against "
          f"one device\n")
    print("| dtype | run | max abs param diff | one-device floor | ratio to floor | verdict |")
    print("|---|---|---|---|---|---|")
    for dtype, run, diff, floor, ratio, text in rows:
        print(f"| {dtype} | {run} | {fmt(diff)} | {fmt(floor)} | {fmt(ratio)} | {text} |")
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description="DDP that matches one device, on your own LightningModule")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--helpers", action="store_true", help="make changes 3 and 4 with vae_ddp's helpers")
    p.add_argument("--check", action="store_true", help="compare DDP on 2 with one device and the floor")
    p.add_argument("--changes", action="store_true", help="print the table of changes")
    p.add_argument("--permutations", type=int, default=4, help="permuted one-device runs for the floor")
    p.add_argument("--save", type=Path, default=None, help="(internal) where a run of --check saves")
    p.add_argument("--out", type=Path, default=Path("out/recipe"))
    args = p.parse_args(argv)
    from vae_ddp.utils import quiet

    quiet()
    if args.changes:
        print(changes_table())
    elif args.check:
        args.out.mkdir(parents=True, exist_ok=True)
        check(args.steps, args.seed, args.permutations, args.out)
    elif args.save is not None and args.devices == 1:
        check_one(args.dtype, args.steps, args.seed, args.permutations, args.save)
    else:
        trainer, model = train(args.devices, args.dtype, args.steps, args.seed, args.helpers)
        if trainer.is_global_zero and args.save is not None:
            torch.save(model.state_dict(), args.save)
        elif trainer.is_global_zero:
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1))
            print(json.dumps(metrics, indent=1))


if __name__ == "__main__":
    main()
