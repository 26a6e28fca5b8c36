"""Should the learning rate change with B/N per device? One device against DDP, same learning rate.

A small regression MLP (8 -> 32 -> 1, tanh, mean squared error) trains for 2 epochs of 64
samples in float64: on one device at global batch size 16, and with Lightning DDP on 2 gloo
processes. Every run sees the same samples in the same order (``GlobalBatchDistributedSampler``,
seeded alike); what is compared with a one-device run is the gradient the optimizer
receives at the first step and the update after 2 epochs (the parameters after training
minus the initial ones), each as ``||run - one device|| / ||one device||`` over all
parameters. The DDP runs:

- 8 per device (global batch size 16), SGD and Adam with the one-device learning rate;
- 16 per device (global batch size 32), SGD with the same learning rate, and with twice it
  (the linear scaling rule: learning rate times the world size), against one device at 16;
- the same 16 per device against one device at global batch size 32.

    python examples/learning_rate.py --out out/learning_rate

Lightning starts rank 1 by re-running this command, so the script runs as is on every
rank (each runs the one-device references too; they are tiny); only rank 0 writes.
"""

import argparse
import json
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from vae_ddp.fixes import GlobalBatchDistributedSampler
from vae_ddp.probes import GradientProbe
from vae_ddp.utils import close_process_group, quiet

SAMPLES, FEATURES, WIDTH, BATCH, EPOCHS = 64, 8, 32, 16, 2
SGD_LR, ADAM_LR = 0.1, 0.01


def regression_data() -> TensorDataset:
    """``x: (SAMPLES, FEATURES)``, ``y: (SAMPLES, 1)``, float64, a fixed random teacher."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g, dtype=torch.float64)
    w = torch.randn(FEATURES, 1, generator=g, dtype=torch.float64)
    return TensorDataset(x, torch.sin(x @ w) + 0.1 * torch.randn(SAMPLES, 1, generator=g, dtype=torch.float64))


# --8<-- [start:model]
class Regression(pl.LightningModule):
    """``x: (b, FEATURES) float64 -> (b, 1)``; the loss is the mean over the per-device batch."""

    def __init__(self, global_batch_size: int, optimizer: str, lr: float) -> None:
        super().__init__()
        self.global_batch_size, self.optimizer_name, self.lr = global_batch_size, optimizer, lr
        self.net = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def train_dataloader(self):
        data = regression_data()
        sampler = GlobalBatchDistributedSampler(data, self.global_batch_size)  # same samples on any world size
        return DataLoader(data, batch_size=self.global_batch_size // sampler.num_replicas, sampler=sampler)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD if self.optimizer_name == "sgd" else torch.optim.Adam
        return optimizer(self.parameters(), lr=self.lr)  # the one-device learning rate, unscaled
# --8<-- [end:model]


def train(devices: int, global_batch_size: int, optimizer: str, lr: float, seed: int) -> dict:
    """The first gradient the optimizer receives and the update after ``EPOCHS`` epochs."""
    pl.seed_everything(seed, verbose=False)
    model = Regression(global_batch_size, optimizer, lr).double()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    probe = GradientProbe(step=0)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                         max_epochs=EPOCHS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, callbacks=[probe])
    trainer.fit(model)
    return {"grad": probe.grads, "update": {n: p.detach() - start[n] for n, p in model.named_parameters()},
            "steps": trainer.global_step}


def rel_diff(a: dict, b: dict) -> float:
    """``||a - b|| / ||b||`` over all parameters (L2 norm of the concatenation)."""
    num = sum(float(((a[n] - b[n]) ** 2).sum()) for n in b)
    den = sum(float((b[n] ** 2).sum()) for n in b)
    return (num / den) ** 0.5


# (key, DDP run as N × per-device batch, its (per-device batch, optimizer, lr), one device as 1 × global batch, its own)
CASES = [
    ("same_global_sgd", "2 × 8, SGD lr 0.1", (8, "sgd", SGD_LR), "1 × 16, lr 0.1", (16, "sgd", SGD_LR)),
    ("same_global_adam", "2 × 8, Adam lr 0.01", (8, "adam", ADAM_LR), "1 × 16, lr 0.01", (16, "adam", ADAM_LR)),
    ("double_global", "2 × 16, SGD lr 0.1", (16, "sgd", SGD_LR), "1 × 16, lr 0.1", (16, "sgd", SGD_LR)),
    ("double_global_scaled_lr", "2 × 16, SGD lr 0.2", (16, "sgd", 2 * SGD_LR), "1 × 16, lr 0.1", (16, "sgd", SGD_LR)),
    ("double_global_vs_one_32", "2 × 16, SGD lr 0.1", (16, "sgd", SGD_LR), "1 × 32, lr 0.1", (32, "sgd", SGD_LR)),
]


def sci(v: float) -> str:
    """Two significant digits; an exact zero as 0."""
    return "0" if v == 0 else f"{v:.1e}"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="the learning rate under DDP at a kept or a doubled global batch")
    p.add_argument("--out", type=Path, default=Path("out/learning_rate"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    quiet()
    world = 2
    # one-device references first (on every rank, before the process group exists), then DDP
    one = {ref: train(1, *ref, seed=args.seed) for ref in dict.fromkeys(c[4] for c in CASES)}
    ddp = {run: train(world, run[0] * world, run[1], run[2], seed=args.seed)
           for run in dict.fromkeys(c[2] for c in CASES)}
    result = {"world_size": world, "samples": SAMPLES, "epochs": EPOCHS, "dtype": "float64"}
    for key, label, run, ref_label, ref in CASES:
        a, b = ddp[run], one[ref]
        result[key] = {"run": label, "reference": ref_label, "ddp_steps": a["steps"], "one_device_steps": b["steps"],
                       "first_grad_rel_diff": rel_diff(a["grad"], b["grad"]),
                       "update_rel_diff": rel_diff(a["update"], b["update"])}
    if pl.utilities.rank_zero_only.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "learning_rate.json").write_text(json.dumps(result, indent=1))
        print(f"float64, {SAMPLES} samples, {EPOCHS} epochs; DDP as world size × per-device batch size, one device "
              f"as 1 × global batch size; ||DDP - one device|| / ||one device|| over all parameters, of the first "
              f"gradient and of the update after {EPOCHS} epochs\n")
        print("| DDP | one device | first gradient | update |")
        print("|---|---|---|---|")
        for key, label, _, ref_label, _ in CASES:
            r = result[key]
            print(f"| {label} | {ref_label} | {sci(r['first_grad_rel_diff'])} | {sci(r['update_rel_diff'])} |")
    close_process_group()
    return result


if __name__ == "__main__":
    main()
