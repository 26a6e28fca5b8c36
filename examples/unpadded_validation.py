"""Validation under DDP: does the accuracy count each sample once?

A fixed linear classifier (3 classes, 8 features, weights from the seed) is validated
with ``trainer.validate`` on a set of 101 samples: on one device, and with Lightning DDP
on 2 gloo processes in three ways:

- Lightning's default: the loader gets a ``DistributedSampler(shuffle=False)``, which pads
  101 to 102 by repeating sample 0, and the accuracy of each batch is logged with
  ``self.log(..., sync_dist=True)``;
- the unrepeated sampler (``vae_ddp.fixes.unrepeated_sampler``: Lightning's
  ``UnrepeatedDistributedSampler``, 51 and 50 samples) with the same logging, which weighs
  each rank by its sample count but, at the epoch end, averages the two counts in an
  integer tensor: their total is odd, the average is rounded down, and the accuracy comes
  out slightly too large (Lightning issues #21838 and #21859);
- the unrepeated sampler with a torchmetrics ``MulticlassAccuracy(average="micro")``
  logged as an object, whose counts are summed over ranks at the epoch end.

Each rank also counts the samples it evaluated (summed over ranks at the epoch end).

    python examples/unpadded_validation.py --out out/validation

Lightning starts rank 1 by re-running this command, so the script runs as is on every
rank; only rank 0 writes.
"""

import argparse
import json
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from vae_ddp.fixes import unrepeated_sampler
from vae_ddp.utils import close_process_group, quiet

CLASSES, FEATURES, BATCH = 3, 8, 10


class Classifier(pl.LightningModule):
    """``x: (b, FEATURES) -> logits: (b, CLASSES)``; ``metric``: ``"tensor"`` or ``"torchmetrics"``."""

    def __init__(self, metric: str) -> None:
        super().__init__()
        self.metric = metric
        self.linear = nn.Linear(FEATURES, CLASSES)
        self.accuracy = MulticlassAccuracy(num_classes=CLASSES, average="micro")
        self.seen = 0

    def validation_step(self, batch, batch_idx):
        x, y = batch
        pred = self.linear(x).argmax(-1)
        self.seen += len(y)
        if self.metric == "tensor":
            self.log("val_acc", (pred == y).double().mean(), sync_dist=True, batch_size=len(y))
        else:
            self.accuracy.update(pred, y)
            self.log("val_acc", self.accuracy, batch_size=len(y))

    def on_validation_epoch_end(self):
        seen = torch.tensor(float(self.seen))
        self.log("val_samples", self.all_gather(seen).sum() if self.trainer.world_size > 1 else seen)


def dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, FEATURES, generator=g, dtype=torch.float64),
                         torch.randint(0, CLASSES, (n,), generator=g))


CASES = {
    "default": ("Lightning's default (padded `DistributedSampler`), `self.log(acc, sync_dist=True)`", "tensor", False),
    "unrepeated": ("`unrepeated_sampler`, `self.log(acc, sync_dist=True)`", "tensor", True),
    "fixed": ("`unrepeated_sampler`, torchmetrics `MulticlassAccuracy` logged as an object", "torchmetrics", True),
}


def validate(case: str, devices: int, n: int, seed: int) -> dict:
    pl.seed_everything(seed, verbose=False)
    model = Classifier(CASES[case][1]).double()
    data = dataset(n, seed)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    if CASES[case][2]:
        model.val_dataloader = lambda: DataLoader(data, batch_size=BATCH, sampler=unrepeated_sampler(data))
    else:
        model.val_dataloader = lambda: DataLoader(data, batch_size=BATCH)
    metrics = trainer.validate(model, verbose=False)[0]
    return {"accuracy": metrics["val_acc"], "samples": int(metrics["val_samples"])}


def sci(v: float) -> str:
    """Two significant digits; an exact zero as 0."""
    return "0" if v == 0 else f"{v:.1e}"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="validation metrics under DDP without padded duplicates")
    p.add_argument("--out", type=Path, default=Path("out/validation"))
    p.add_argument("--samples", type=int, default=101)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    quiet()
    pl.seed_everything(args.seed, verbose=False)
    model = Classifier("tensor").double()
    x, y = dataset(args.samples, args.seed).tensors
    with torch.no_grad():
        correct = int((model.linear(x).argmax(-1) == y).sum())
    one = validate("fixed", 1, args.samples, args.seed)
    result = {"samples": args.samples, "world_size": 2, "correct": correct, "one_device": one,
              "one_device_exact": correct / args.samples}
    for case in CASES:
        r = validate(case, 2, args.samples, args.seed)
        r["abs_diff_vs_one_device"] = abs(r["accuracy"] - one["accuracy"])
        result[case] = r
    if pl.utilities.rank_zero_only.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "unpadded_validation.json").write_text(json.dumps(result, indent=1))
        print(f"{args.samples} validation samples; one device: accuracy {one['accuracy']:.6f} "
              f"({correct} of {args.samples} correct)\n")
        print("| DDP on 2 devices | samples evaluated | accuracy | difference from one device |")
        print("|---|---|---|---|")
        for case, (label, _, _) in CASES.items():
            r = result[case]
            print(f"| {label} | {r['samples']} | {r['accuracy']:.6f} | {sci(r['abs_diff_vs_one_device'])} |")
    close_process_group()  # Lightning leaves the group open after fit; gloo can abort at exit
    return result


if __name__ == "__main__":
    main()
