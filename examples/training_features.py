"""Other training features under the recipe: one device against DDP on 2 processes, float64.

A tiny regression model that is not this project's VAE (``Linear -> BatchNorm1d -> Tanh ->
Linear``) trains a few steps on one device with global batch B, and with DDP on 2 gloo
processes with per-device batch B/2 and every fix on (``GlobalSyncBatchNorm``, the
global-batch sampler, randomness drawn for the global batch). Each row adds one training
feature; the first row has none and is the floor both are measured against:

- two optimizers with manual optimization (``automatic_optimization = False``, two
  ``manual_backward`` per step, Adam and SGD, latent noise drawn for the global batch);
- ``Trainer(accumulate_grad_batches=2)``;
- DataLoader workers (2 per rank on DDP, none on one device) with a random augmentation
  keyed by (seed, epoch, sample index): a sample is augmented alike on any world size and
  any number of workers;
- the same workers with the augmentation drawn from each worker's own stream, seeded per rank
  and worker by ``seed_everything(seed, workers=True)`` (Lightning's advice): different on
  each rank and worker, hence not the single device's.

    python examples/training_features.py --out DIR [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from vae_ddp.fixes import GlobalBatchDistributedSampler, GlobalSyncBatchNorm
from vae_ddp.utils import close_process_group
from vae_ddp.workers import worker_context

FEATURES = {
    "none": "no feature (the floor)",
    "two_optimizers": "two optimizers, manual optimization",
    "accumulate": "`accumulate_grad_batches=2`",
    "workers_keyed": "2 DataLoader workers, augmentation keyed by sample",
    "workers_seeded": "2 DataLoader workers, augmentation seeded per rank and worker",
}
GLOBAL_BATCH = 8
SEED = 7
PRE_BN = ("body.0.bias", "body.1.running_mean")  # the bias before the BatchNorm, and what it feeds


class Regression(Dataset):
    """64 samples ``x: (8,)``, ``y: (8,)`` float64; with ``augment``, ``x`` gets random noise:
    ``"keyed"`` from a generator seeded by (seed, epoch, index), ``"stream"`` from the process's
    global torch stream (a worker's, seeded by Lightning's worker_init_fn)."""

    def __init__(self, augment: str = "") -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 8, generator=g, dtype=torch.float64)
        self.y = torch.sin(self.x @ torch.randn(8, 8, generator=g, dtype=torch.float64))
        self.augment, self.epoch = augment, 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i]
        if self.augment == "keyed":
            g = torch.Generator().manual_seed((SEED * 1_000_003 + self.epoch) * 1_000_003 + i)
            x = x + 0.1 * torch.randn(x.shape, generator=g, dtype=x.dtype)
        elif self.augment == "stream":
            x = x + 0.1 * torch.randn(x.shape, dtype=x.dtype)
        return x, self.y[i]


class Tiny(pl.LightningModule):
    def __init__(self, feature: str) -> None:
        super().__init__()
        self.feature = feature
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh())
        self.head = nn.Linear(16, 8)
        self.automatic_optimization = feature != "two_optimizers"
        augment = {"workers_keyed": "keyed", "workers_seeded": "stream"}.get(feature, "")
        self.dataset = Regression(augment)
        self.workers = 2 if feature.startswith("workers") else 0
        self.batches = 0

    def forward(self, x):
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.automatic_optimization:
            return F.mse_loss(self(x), y)
        # Two optimizers, manual optimization: the body steps on a noisy-input loss (noise drawn
        # for the global batch, this rank's rows kept), then the head on the clean loss.
        opt_body, opt_head = self.optimizers()
        world, rank = self.trainer.world_size, self.trainer.global_rank
        g = torch.Generator().manual_seed(SEED * 1_000_003 + self.batches)
        z = torch.randn(GLOBAL_BATCH, 8, generator=g, dtype=x.dtype)
        z = z.view(world, -1, 8)[rank]
        self.batches += 1
        for opt, loss in ((opt_body, F.mse_loss(self(x + 0.1 * z), y)), (opt_head, None)):
            loss = F.mse_loss(self(x), y) if loss is None else loss
            opt_body.zero_grad(), opt_head.zero_grad()
            self.manual_backward(loss)
            opt.step()

    def on_train_epoch_start(self) -> None:
        self.dataset.epoch = self.current_epoch  # before Lightning starts this epoch's workers

    def train_dataloader(self):
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = GlobalBatchDistributedSampler(self.dataset, GLOBAL_BATCH, num_replicas=world, rank=rank, seed=SEED)
        workers = self.workers if world > 1 else 0
        # workers from a forkserver (torch and Lightning preloaded): a forked worker can hang (vae_ddp.workers)
        return DataLoader(self.dataset, batch_size=GLOBAL_BATCH // world, sampler=sampler, num_workers=workers,
                          multiprocessing_context=worker_context() if workers else None)

    def configure_optimizers(self):
        if self.automatic_optimization:
            return torch.optim.Adam(self.parameters(), lr=1e-2)
        return [torch.optim.Adam(self.body.parameters(), lr=1e-2), torch.optim.SGD(self.head.parameters(), lr=1e-1)]


def train(feature: str, devices: int, steps: int) -> dict[str, torch.Tensor]:
    """Final parameters of one run (every process trains; all hold the same parameters)."""
    pl.seed_everything(SEED, workers=True, verbose=False)
    model = Tiny(feature)
    optimizer_steps = 2 * steps if feature == "two_optimizers" else steps  # manual: global_step counts both
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                         precision="64-true", max_steps=optimizer_steps, max_epochs=-1,
                         accumulate_grad_batches=2 if feature == "accumulate" else 1,
                         plugins=[GlobalSyncBatchNorm()] if devices > 1 else None,
                         use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}


def child(devices: int, steps: int, out: Path) -> None:
    """One launch trains every feature in turn (Lightning starts rank 1 by re-running this command)."""
    result = {feature: train(feature, devices, steps) for feature in FEATURES}
    if int(__import__("os").environ.get("LOCAL_RANK", "0")) == 0:
        torch.save(result, out)
    close_process_group()  # Lightning leaves the group open after fit; gloo can abort at exit


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=8, help="optimizer steps (a few epochs of 8 batches of 8 samples)")
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)  # devices, in a child launch
    args = p.parse_args(argv)
    if args.child:
        return child(args.child, args.steps, args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {}
    for devices in (1, 2):
        path = args.out / f"params-{devices}.pt"
        proc = subprocess.run([sys.executable, __file__, "--out", str(path), "--steps", str(args.steps),
                               "--child", str(devices)], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"the {devices}-device launch failed:\n{proc.stderr[-3000:]}")
        runs[devices] = torch.load(path, weights_only=True)
    def max_diff(feature: str, keys) -> float:
        return max(float((runs[2][feature][k] - runs[1][feature][k]).abs().max()) for k in keys)

    diffs = {f: max_diff(f, runs[1][f]) for f in FEATURES}
    # The bias of the Linear just before the BatchNorm has an exactly zero gradient (BatchNorm
    # subtracts the mean): its Adam step is rounding noise / (rounding noise + eps), and the
    # running mean follows it. Everything else, separately:
    rest = {f: max_diff(f, [k for k in runs[1][f] if k not in PRE_BN]) for f in FEATURES}
    floor = diffs["none"]
    print(f"Global batch {GLOBAL_BATCH}, {args.steps} optimizer steps, float64; DDP: 2 processes, every fix on.\n")
    print("| training feature | max abs(θ DDP − θ one device) | verdict | the same without the bias before BatchNorm |")
    print("|---|---|---|---|")
    for feature, label in FEATURES.items():
        d = diffs[feature]
        ratio = d / max(floor, 1e-16)
        verdict = "—" if feature == "none" else (
            "at the floor" if ratio <= 10 else f"above the floor, by {math.log10(ratio):.0f} orders of magnitude")
        print(f"| {label} | {d:.3g} | {verdict} | {rest[feature]:.3g} |")
    (args.out / "training_features.json").write_text(
        json.dumps({"diffs": diffs, "without_pre_bn_bias": rest, "steps": args.steps}, indent=1))
    return diffs


if __name__ == "__main__":
    main()
