"""Random draws in a collate_fn and in DataLoader workers: are they the same on every rank?

A small regression MLP (6 -> 16 -> 1, tanh, mean squared error, float64) is trained for
2 epochs of 32 samples, its ``collate_fn`` masking each feature of each sample with
probability 0.25 (a BERT-style masking collator): the collator draws one uniform number per
feature and sample and sets the feature to 0 where it is below 0.25. One device (global
batch size 8) is compared with Lightning DDP on 2 gloo processes (4 per device, the same
samples at every step through ``GlobalBatchDistributedSampler``), each run after
``seed_everything(0)``. Six ways to draw:

- ``torch.rand`` in the collate_fn, the loader without workers (the draw runs in the rank);
- the same with ``seed_everything(0, workers=True)``;
- the same in 1 DataLoader worker per rank, PyTorch's default worker seeding, and with
  ``seed_everything(0, workers=True)`` (Lightning's ``pl_worker_init_function``);
- keyed to the sample: each sample's numbers drawn from a ``torch.Generator`` seeded from
  (seed, epoch, sample index), without workers and with 1 worker per rank.

Measured: the fraction of rank 1's draws equal to rank 0's at the same position of the
batch, the fraction of DDP draws equal to one device's draw for the same sample and epoch,
the gradient the optimizer receives at the first step against one device's, and (in the
JSON) whether a sample's draw changes from one epoch to the next on one device.

    python examples/collate_randomness.py --out out/collate_randomness

Lightning starts rank 1 by re-running this command, so the script runs as is on every
rank; the one-device runs are made on rank 0 only; only rank 0 writes.
"""

import argparse
import json
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.utilities import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

from vae_ddp.fixes import GlobalBatchDistributedSampler
from vae_ddp.fixes.augmentation import sample_seed
from vae_ddp.probes import GradientProbe
from vae_ddp.utils import close_process_group, quiet
from vae_ddp.workers import worker_context

SAMPLES, FEATURES, WIDTH, GLOBAL_BATCH, MASK_P, EPOCHS = 32, 6, 16, 8, 0.25, 2
STEPS_PER_EPOCH = SAMPLES // GLOBAL_BATCH


class Regression(Dataset):
    """``(index, x, y)``: ``index`` int, ``x: (FEATURES,)``, ``y: (1,)``, float64, a fixed random teacher."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, FEATURES, generator=g, dtype=torch.float64)
        w = torch.randn(FEATURES, 1, generator=g, dtype=torch.float64)
        self.y = torch.sin(self.x @ w)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return i, self.x[i], self.y[i]


def masked(index, x, y, u):
    """The batch the model sees; ``u: (b, FEATURES)`` uniform numbers, returned to be measured."""
    return {"index": index, "x": x * (u >= MASK_P), "y": y, "u": u}


class PlainMasking:
    """The usual collator: draws from the generator of the process that runs it."""

    def __call__(self, samples):
        index, x, y = default_collate(samples)
        u = torch.rand(x.shape, dtype=x.dtype)  # the rank's generator, or the worker's
        return masked(index, x, y, u)


# --8<-- [start:keyed]
class KeyedMasking:
    """The fix: sample ``i`` of epoch ``e`` draws from a generator seeded from ``(seed, e, i)``."""

    def __init__(self, seed: int) -> None:
        self.seed, self.epoch = seed, 0

    def draw(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(sample_seed(self.seed, self.epoch, index))  # a 63-bit mix of the three
        return torch.rand(FEATURES, generator=g, dtype=torch.float64)

    def __call__(self, samples):
        index, x, y = default_collate(samples)
        u = torch.stack([self.draw(int(i)) for i in index])
        return masked(index, x, y, u)
# --8<-- [end:keyed]


class Masked(pl.LightningModule):
    """``x: (b, FEATURES) -> (b, 1)``; the batch comes from ``collate`` with ``workers`` DataLoader workers."""

    def __init__(self, collate, workers: int) -> None:
        super().__init__()
        self.collate, self.workers = collate, workers
        self.net = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
        self.drawn: list = []

    def training_step(self, batch, batch_idx):
        self.drawn.append((batch["index"], batch["u"]))
        return F.mse_loss(self.net(batch["x"]), batch["y"])

    # --8<-- [start:epoch]
    def on_train_epoch_start(self):  # from epoch 1 on, Lightning starts the epoch's iterator (and workers) after it
        if isinstance(self.collate, KeyedMasking):
            self.collate.epoch = self.current_epoch
    # --8<-- [end:epoch]

    def train_dataloader(self):
        data = Regression()
        sampler = GlobalBatchDistributedSampler(data, GLOBAL_BATCH)
        # workers from a forkserver (torch and Lightning preloaded): a forked worker can hang (vae_ddp.workers)
        workers = {"num_workers": self.workers, "multiprocessing_context": worker_context()} if self.workers else {}
        return DataLoader(data, batch_size=GLOBAL_BATCH // sampler.num_replicas, sampler=sampler,
                          collate_fn=self.collate, **workers)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class GatherDraws(pl.Callback):
    """After training: ``index: (world, steps, b)`` and ``u: (world, steps, b, FEATURES)`` of every rank."""

    def on_train_end(self, trainer, pl_module):
        index = torch.stack([i for i, _ in pl_module.drawn])
        u = torch.stack([u for _, u in pl_module.drawn])
        if trainer.world_size > 1:
            index, u = trainer.strategy.all_gather(index), trainer.strategy.all_gather(u)
        else:
            index, u = index[None], u[None]
        self.index, self.u = index, u


#: case: (label, keyed, DataLoader workers per rank, seed_everything(..., workers=...))
CASES = {
    "main": ("`torch.rand`, 0 workers", False, 0, False),
    "main_seeded": ("`torch.rand`, 0 workers, `workers=True`", False, 0, True),
    "worker": ("`torch.rand`, 1 worker", False, 1, False),
    "worker_seeded": ("`torch.rand`, 1 worker, `workers=True`", False, 1, True),
    "keyed": ("keyed to the sample, 0 workers", True, 0, False),
    "keyed_worker": ("keyed to the sample, 1 worker", True, 1, False),
}


def run(case: str, devices: int, seed: int) -> dict:
    """``EPOCHS`` epochs: the first gradient and every rank's draws."""
    _, keyed, workers, seed_workers = CASES[case]
    pl.seed_everything(seed, workers=seed_workers, verbose=False)  # also sets PL_SEED_WORKERS for this run
    model = Masked(KeyedMasking(seed) if keyed else PlainMasking(), workers).double()
    probe, draws = GradientProbe(step=0), GatherDraws()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                         max_epochs=EPOCHS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, callbacks=[probe, draws])
    trainer.fit(model)
    return {"grads": probe.grads, "index": draws.index, "u": draws.u}


def compare(single: dict, ddp: dict) -> dict:
    """Fractions of equal draws and the first gradient's difference."""
    def by_sample(run):  # {(epoch, index): (FEATURES,) draw}
        index, u = run["index"], run["u"]                 # (world, steps, b), (world, steps, b, FEATURES)
        return {(k // STEPS_PER_EPOCH, int(index[r, k, j])): u[r, k, j]
                for r in range(index.shape[0]) for k in range(index.shape[1]) for j in range(index.shape[2])}
    one, two = by_sample(single), by_sample(ddp)
    u = ddp["u"]
    scale = max(float(g.abs().max()) for g in single["grads"].values())
    diff = max(float((ddp["grads"][n] - g).abs().max()) for n, g in single["grads"].items())
    return {"repeated_across_ranks": float((u[0] == u[1]).double().mean()),
            "same_as_one_device": float(torch.stack([two[k] == one[k] for k in two]).double().mean()),
            "epoch1_same_as_epoch0": float(torch.stack([one[1, i] == one[0, i] for i in range(SAMPLES)]).double()
                                           .mean()),
            "grad_rel_diff": diff / scale, "draws_per_rank": u[0].numel()}


def pct(v: float) -> str:
    return f"{100 * v:.3g} %"


def sci(v: float) -> str:
    """Two significant digits; an exact zero as 0."""
    return "0" if v == 0 else f"{v:.1e}"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="random draws in collate_fn and DataLoader workers under DDP")
    p.add_argument("--out", type=Path, default=Path("out/collate_randomness"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    quiet()
    # one-device references on rank 0 only (rank 1 starts at the first DDP fit and needs none)
    single = {case: run(case, 1, args.seed) for case in CASES} if rank_zero_only.rank == 0 else {}
    ddp = {case: run(case, 2, args.seed) for case in CASES}
    result = {"world_size": 2, "global_batch_size": GLOBAL_BATCH, "samples": SAMPLES, "dtype": "float64",
              "mask_probability": MASK_P}
    if rank_zero_only.rank == 0:
        for case in CASES:
            result[case] = compare(single[case], ddp[case])
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "collate_randomness.json").write_text(json.dumps(result, indent=1))
        print(f"one device (global batch {GLOBAL_BATCH}) vs DDP (2 × {GLOBAL_BATCH // 2}), float64, {EPOCHS} epochs "
              f"of {STEPS_PER_EPOCH} steps, {result['main']['draws_per_rank']} uniform draws per rank; DataLoader "
              f"workers per rank; seed_everything(0) (`workers=True`: seed_everything(0, workers=True)); first "
              f"gradient: max abs diff / max abs one-device gradient\n")
        print("| draw in `collate_fn` | rank 1 = rank 0 | = one device | first gradient |")
        print("|---|---|---|---|")
        for case, (label, *_) in CASES.items():
            r = result[case]
            print(f"| {label} | {pct(r['repeated_across_ranks'])} | {pct(r['same_as_one_device'])} | "
                  f"{sci(r['grad_rel_diff'])} |")
    close_process_group()
    return result


if __name__ == "__main__":
    main()
