"""The recipe on your own LightningModule: DDP that computes what one device computes.

``BottleneckClassifier`` stands for your module. It is not this site's VAE, but it has
what the factors act on: BatchNorm, a reparameterized Gaussian layer (a variational
information bottleneck, Alemi et al. 2017, arXiv:1612.00410), a mean loss and logged
metrics; batches are ``(x, y)`` from scikit-learn's bundled digits (no download). The
lines marked ``# change N`` are the whole recipe, in plain Lightning/torch
(``GlobalSyncBatchNorm`` stands in for ``sync_batchnorm=True`` on CPU, where PyTorch's
SyncBatchNorm refuses to run).

    python examples/recipe.py --devices 2 --out out/recipe    # DDP on 2 processes (gloo on CPU)
    python examples/recipe.py --devices 1 --out out/recipe    # one device, the same global batch

Each run prints the last logged metrics (means over the global batch) and writes them to
``OUT/metrics.json``, and the trained weights to ``OUT/model.pt``;
``examples/recipe_check.py`` trains with this script's ``train`` and compares each step's
gradient with one device's.
"""

import argparse
import json
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from vae_ddp.fixes import GlobalSyncBatchNorm
from vae_ddp.utils import close_process_group

#: The global batch size: the same at every world size (2, 3 and 4 divide it; each rank trains on its share).
GLOBAL_BATCH_SIZE = 96


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
        batch = self.trainer.fit_loop.total_batch_idx  # not global_step: accumulated batches share a step
        g = torch.Generator(mu.device).manual_seed(self.hparams.seed * 1_000_003 + batch)
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

    def __init__(self, global_batch_size: int = GLOBAL_BATCH_SIZE, seed: int = 0):
        super().__init__()
        self.global_batch_size, self.seed = global_batch_size, seed

    def train_dataloader(self):
        from sklearn.datasets import load_digits

        d = load_digits()
        ds = TensorDataset(torch.tensor(d.data / 16, dtype=torch.float32), torch.tensor(d.target))
        world, rank = self.trainer.world_size, self.trainer.global_rank
        if self.global_batch_size % world:  # change 3: every rank the same share of the global batch
            raise ValueError(f"global batch {self.global_batch_size} does not divide by world size {world}")
        return DataLoader(ds, batch_size=self.global_batch_size // world, sampler=self.sampler(ds, world, rank),
                          drop_last=True)  # change 3: equal per-rank batches

    def sampler(self, ds, world, rank):  # change 3: the same global batches at any world size
        return DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=self.seed, drop_last=True)
# --8<-- [end:module]


def train(devices: int, dtype: str, steps: int, seed: int, callbacks=(), data_class=None):
    """Train one run; return the Trainer and the module (rank 0 reads the result)."""
    # --8<-- [start:fixes]
    pl.seed_everything(seed)
    model = BottleneckClassifier(seed=seed)
    data = Digits(global_batch_size=GLOBAL_BATCH_SIZE, seed=seed)
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
    if data_class is not None:
        data = data_class(global_batch_size=GLOBAL_BATCH_SIZE, seed=seed)
    trainer.callbacks.extend(callbacks)
    trainer.fit(model, datamodule=data)
    return trainer, model


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="DDP that matches one device, on your own LightningModule")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out/recipe"))
    args = p.parse_args(argv)
    trainer, model = train(args.devices, args.dtype, args.steps, args.seed)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if trainer.is_global_zero:  # Lightning re-runs this script for rank 1; rank 0 writes
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1))
        torch.save(model.state_dict(), args.out / "model.pt")
        print(json.dumps(metrics, indent=1))
    close_process_group()  # Lightning leaves the group open after fit; gloo can abort at exit
    return metrics


if __name__ == "__main__":
    main()
