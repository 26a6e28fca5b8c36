"""Gradient accumulation or DDP with BatchNorm: which matches which, and what does broadcast_buffers do?

A small regression MLP with one BatchNorm layer (8 -> 16, ``nn.BatchNorm1d(16)``, ReLU,
-> 1, mean squared error, float64, SGD) trains for 3 optimizer steps at global batch size
16, every run on the same samples in the same order (``GlobalBatchDistributedSampler``):

- one device, batch 16;
- one device, 2 micro-batches of 8 with ``Trainer(accumulate_grad_batches=2)``;
- Lightning DDP on 2 gloo processes, 8 per device (rank ``r`` gets the ``r``-th half of
  each global batch, the accumulation's ``r``-th micro-batch), with
  ``DDPStrategy(broadcast_buffers=True)`` (the default), ``broadcast_buffers=False``,
  ``forward_sync_buffers=False`` (torch 2.13's name for it), and with BatchNorm over
  the global batch (``GlobalSyncBatchNorm``).

Measured: the gradient the optimizer receives at the first step, against one device's and
against the accumulation's; how many times per optimizer step the BatchNorm running
statistics are updated (``num_batches_tracked``); the BatchNorm ``running_mean`` of rank 1
against rank 0's, as the layer receives it at the start of each forward and at the end of
training; and rank 0's ``running_mean`` after the 3 steps against one device's.

    python examples/accumulation_batchnorm.py --out out/accumulation_batchnorm

Lightning starts rank 1 by re-running this command, so the script runs as is on every
rank; the one-device runs are made on rank 0 only; only rank 0 writes.
"""

import argparse
import json
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.utilities import rank_zero_only
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, TensorDataset

from vae_ddp.fixes import GlobalBatchDistributedSampler, GlobalSyncBatchNorm
from vae_ddp.probes import GradientProbe
from vae_ddp.utils import close_process_group, quiet

SAMPLES, FEATURES, WIDTH, GLOBAL_BATCH, STEPS = 64, 8, 16, 16, 3


def regression_data() -> TensorDataset:
    """``x: (SAMPLES, FEATURES)`` (mean 1, so the running mean moves), ``y: (SAMPLES, 1)``, float64."""
    g = torch.Generator().manual_seed(0)
    x = 1 + torch.randn(SAMPLES, FEATURES, generator=g, dtype=torch.float64)
    w = torch.randn(FEATURES, 1, generator=g, dtype=torch.float64)
    return TensorDataset(x, torch.sin(x @ w))


class WithBatchNorm(pl.LightningModule):
    """``x: (b, FEATURES) -> (b, 1)``; batches of ``GLOBAL_BATCH / (world size * accumulate)``."""

    def __init__(self, accumulate: int) -> None:
        super().__init__()
        self.accumulate = accumulate
        self.net = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def train_dataloader(self):
        data = regression_data()
        sampler = GlobalBatchDistributedSampler(data, GLOBAL_BATCH)  # rank r: the r-th half of each global batch
        return DataLoader(data, batch_size=GLOBAL_BATCH // sampler.num_replicas // self.accumulate, sampler=sampler)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class BatchNormProbe(pl.Callback):
    """Records the BatchNorm ``running_mean`` as the layer receives it at each forward (a forward
    pre-hook: after DDP's buffer broadcast, before the layer's own update), and the buffers
    after training; gathered from every rank: ``entering: (world, forwards, WIDTH)``,
    ``running_mean: (world, WIDTH)``, ``num_batches_tracked: (world,)``."""

    def on_train_start(self, trainer, pl_module):  # after GlobalSyncBatchNorm replaced the layer
        self.layer = next(m for m in pl_module.modules() if isinstance(m, _BatchNorm))
        self.seen = []
        self.layer.register_forward_pre_hook(lambda m, args: self.seen.append(m.running_mean.detach().clone()))

    def on_train_end(self, trainer, pl_module):
        found = [torch.stack(self.seen), self.layer.running_mean.detach().clone(),
                 self.layer.num_batches_tracked.detach().clone()]
        if trainer.world_size > 1:
            found = [trainer.strategy.all_gather(t) for t in found]
        else:
            found = [t[None] for t in found]
        self.entering, self.running_mean, self.num_batches_tracked = found


# --8<-- [start:runs]
#: run: (label, devices, accumulate_grad_batches, DDPStrategy keyword arguments, GlobalSyncBatchNorm)
RUNS = {
    "one": ("one device, 16", 1, 1, None, False),
    "accumulate": ("one device, 2 × 8 accumulated", 1, 2, None, False),
    "ddp": ("DDP, `broadcast_buffers=True`", 2, 1, {}, False),
    "no_broadcast": ("DDP, `broadcast_buffers=False`", 2, 1, {"broadcast_buffers": False}, False),
    "no_forward_sync": ("DDP, `forward_sync_buffers=False`", 2, 1, {"forward_sync_buffers": False}, False),
    "sync": ("DDP, `GlobalSyncBatchNorm`", 2, 1, {}, True),
}


def train(run: str, seed: int) -> dict:
    """``STEPS`` optimizer steps: the first gradient and the BatchNorm buffers of every rank."""
    _, devices, accumulate, ddp_kwargs, sync = RUNS[run]
    pl.seed_everything(seed, verbose=False)
    model = WithBatchNorm(accumulate).double()
    probe, bn = GradientProbe(step=0), BatchNormProbe()
    trainer = pl.Trainer(accelerator="cpu", devices=devices,
                         strategy=DDPStrategy(**ddp_kwargs) if devices > 1 else "auto",
                         plugins=[GlobalSyncBatchNorm()] if sync else None,
                         accumulate_grad_batches=accumulate, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=[probe, bn])
    trainer.fit(model)
    return {"grads": probe.grads, "entering": bn.entering, "running_mean": bn.running_mean,
            "num_batches_tracked": bn.num_batches_tracked}
# --8<-- [end:runs]


def grad_rel_diff(a: dict, b: dict) -> float:
    """max |a - b| / max |b| over all parameters."""
    return max(float((a[n] - g).abs().max()) for n, g in b.items()) / max(float(g.abs().max()) for g in b.values())


def sci(v: float) -> str:
    """Two significant digits; an exact zero as 0."""
    return "0" if v == 0 else f"{v:.1e}"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="gradient accumulation, DDP, BatchNorm and broadcast_buffers")
    p.add_argument("--out", type=Path, default=Path("out/accumulation_batchnorm"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    quiet()
    # torch >= 2.13 warns (FutureWarning) that `broadcast_buffers` is deprecated for `forward_sync_buffers`
    warnings.filterwarnings("ignore", message=".*broadcast_buffers.* is deprecated.*")
    # one-device runs on rank 0 only (rank 1 starts at the first DDP fit and needs none)
    runs = [r for r, spec in RUNS.items() if spec[1] > 1 or rank_zero_only.rank == 0]
    out = {run: train(run, args.seed) for run in runs}
    result = {"world_size": 2, "global_batch_size": GLOBAL_BATCH, "steps": STEPS, "dtype": "float64",
              "momentum": 0.1}
    if rank_zero_only.rank == 0:
        one, acc = out["one"], out["accumulate"]
        for run, (label, devices, *_rest) in RUNS.items():
            r = out[run]
            result[run] = {
                "label": label,
                "grad_rel_diff_vs_one": grad_rel_diff(r["grads"], one["grads"]),
                "grad_rel_diff_vs_accumulate": grad_rel_diff(r["grads"], acc["grads"]),
                "bn_updates": [int(n) for n in r["num_batches_tracked"]],
                "bn_updates_per_step": int(r["num_batches_tracked"][0]) / STEPS,
                "running_mean_rank0_vs_one": float((r["running_mean"][0] - one["running_mean"][0]).abs().max()),
                "running_mean_scale_one": float(one["running_mean"][0].abs().max()),
            }
            if devices > 1:
                e = r["entering"]  # (2, STEPS, WIDTH)
                result[run]["entering_rank1_vs_rank0"] = [float((e[1, k] - e[0, k]).abs().max()) for k in range(STEPS)]
                result[run]["running_mean_rank1_vs_rank0"] = float((r["running_mean"][1] - r["running_mean"][0])
                                                                   .abs().max())
        result["rank0_broadcast_vs_no_broadcast"] = float((out["ddp"]["running_mean"][0]
                                                           - out["no_broadcast"]["running_mean"][0]).abs().max())
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "accumulation_batchnorm.json").write_text(json.dumps(result, indent=1))
        print(f"global batch size {GLOBAL_BATCH}, the same samples in every run: one device at {GLOBAL_BATCH}, or 2 "
              f"micro-batches of {GLOBAL_BATCH // 2} (`accumulate_grad_batches=2`); DDP: 2 ranks × "
              f"{GLOBAL_BATCH // 2}; float64, SGD; gradients: max abs diff / max abs reference gradient at the first "
              f"step\n")
        print("| run | first gradient vs one device | vs accumulation |")
        print("|---|---|---|")
        for run in ("accumulate", "ddp", "sync"):
            r = result[run]
            vs_acc = "" if run == "accumulate" else sci(r["grad_rel_diff_vs_accumulate"])
            print(f"| {r['label']} | {sci(r['grad_rel_diff_vs_one'])} | {vs_acc} |")
        print(f"\nBatchNorm `running_mean` (momentum 0.1), max abs diff: entering each forward (largest over the "
              f"steps), and at the end, after {STEPS} steps; its largest entry on one device at the end: "
              f"{result['one']['running_mean_scale_one']:.2f}\n")
        print("| run | updates per step | rank 1 vs rank 0: forward / end | rank 0 vs one device: end |")
        print("|---|---|---|---|")
        for run, (label, devices, *_rest) in RUNS.items():
            r = result[run]
            ranks = (f"{sci(max(r['entering_rank1_vs_rank0']))} / {sci(r['running_mean_rank1_vs_rank0'])}"
                     if devices > 1 else "")
            print(f"| {label} | {r['bn_updates_per_step']:g} | {ranks} | {sci(r['running_mean_rank0_vs_one'])} |")
    close_process_group()
    return result


if __name__ == "__main__":
    main()
