"""A loss summed over the batch under DDP: is the first gradient one device's?

A small regression MLP with ``F.mse_loss(..., reduction="sum")`` over the per-device batch.
One device (global batch 16) is compared with Lightning DDP on 2 gloo processes (8
samples per device, the same samples through ``GlobalBatchDistributedSampler``, float64):
the gradient the optimizer receives at the first step, and the change of the parameters
in that step (plain SGD). Three losses under DDP, each against the same loss on one device:

- the sum over the per-device batch;
- that sum times the world size (``loss * self.trainer.world_size``);
- the mean (``reduction="mean"``), with equal per-device batch sizes.

    python examples/summed_loss.py --out out/summed_loss

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
from torch.utils.data import DataLoader, Dataset

from vae_ddp.fixes import GlobalBatchDistributedSampler
from vae_ddp.probes import GradientProbe
from vae_ddp.utils import close_process_group, quiet

FEATURES, HIDDEN, SAMPLES, GLOBAL_BATCH, LR = 8, 16, 64, 16, 0.01


class Regression(pl.LightningModule):
    """``x: (b, FEATURES) -> (b, 1)``; ``loss`` is one of ``LOSSES``."""

    def __init__(self, loss: str) -> None:
        super().__init__()
        self.loss_kind = loss
        self.net = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))

    def forward(self, x):
        return self.net(x)

    # --8<-- [start:step]
    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.loss_kind == "sum":
            loss = F.mse_loss(self(x), y, reduction="sum")
        elif self.loss_kind == "sum_times_world_size":
            loss = F.mse_loss(self(x), y, reduction="sum") * self.trainer.world_size
        else:  # "mean"
            loss = F.mse_loss(self(x), y, reduction="mean")
        return loss
    # --8<-- [end:step]

    def train_dataloader(self):
        data = Points()
        sampler = GlobalBatchDistributedSampler(data, GLOBAL_BATCH)
        return DataLoader(data, batch_size=GLOBAL_BATCH // sampler.num_replicas, sampler=sampler)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class Points(Dataset):
    """``(x, y)``: ``x: (FEATURES,)``, ``y: (1,)`` float64, ``y = sin(x . w) + 0.1 noise``."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, FEATURES, generator=g, dtype=torch.float64)
        w = torch.randn(FEATURES, 1, generator=g, dtype=torch.float64)
        self.y = torch.sin(self.x @ w) + 0.1 * torch.randn(SAMPLES, 1, generator=g, dtype=torch.float64)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return self.x[i], self.y[i]


LOSSES = {"sum": '`reduction="sum"`',
          "sum_times_world_size": '`reduction="sum"` times `world_size`',
          "mean": '`reduction="mean"`'}
#: The loss one device runs for each DDP loss (on one device the world size is 1).
REFERENCE = {"sum": "sum", "sum_times_world_size": "sum", "mean": "mean"}


def first_step(loss: str, devices: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient the optimizer receives at step 0 and the change of the parameters in
    that step, each flattened into one vector."""
    pl.seed_everything(seed, verbose=False)
    model = Regression(loss).double()
    probe = GradientProbe(step=0)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, callbacks=[probe])
    trainer.fit(model)
    names = sorted(probe.grads)
    after = dict(model.named_parameters())
    grad = torch.cat([probe.grads[n].flatten() for n in names])
    change = torch.cat([(after[n].detach() - probe.params[n]).flatten() for n in names])
    return grad, change


def sci(v: float) -> str:
    """Two significant digits; an exact zero as 0."""
    return "0" if v == 0 else f"{v:.1e}"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="a summed loss under DDP")
    p.add_argument("--out", type=Path, default=Path("out/summed_loss"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    quiet()
    refs = {kind: first_step(kind, 1, args.seed) for kind in ("sum", "mean")}
    world = 2
    result = {"global_batch_size": GLOBAL_BATCH, "world_size": world, "dtype": "float64", "lr": LR}
    for loss in LOSSES:
        ref_grad, ref_change = refs[REFERENCE[loss]]
        grad, change = first_step(loss, world, args.seed)
        result[loss] = {"grad_ratio": float(grad @ ref_grad / (ref_grad @ ref_grad)),
                        "grad_rel_diff": float((grad - ref_grad).abs().max() / ref_grad.abs().max()),
                        "step_ratio": float(change @ ref_change / (ref_change @ ref_change)),
                        "step_rel_diff": float((change - ref_change).abs().max() / ref_change.abs().max())}
    if pl.utilities.rank_zero_only.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summed_loss.json").write_text(json.dumps(result, indent=1))
        print(f"one device (batch {GLOBAL_BATCH}) vs DDP ({world} x {GLOBAL_BATCH // world}), float64, first step, "
              f"SGD lr={LR}; ratio = DDP / one device (projection onto one device's vector)\n")
        print("| loss under DDP | gradient ratio | gradient: max abs diff / max abs | SGD step ratio |")
        print("|---|---|---|---|")
        for loss, label in LOSSES.items():
            r = result[loss]
            print(f"| {label} | {r['grad_ratio']:.4f} | {sci(r['grad_rel_diff'])} | {r['step_ratio']:.4f} |")
    close_process_group()
    return result


if __name__ == "__main__":
    main()
