"""Run a small foreign LightningModule under 2-rank DDP (gloo) with DDPAudit; rank 0 writes the findings.

Usage: python tests/scripts/audit_callback.py OUT_DIR {exposed,clean} [...]: one fit per mode, in one launch
(Lightning's launcher starts rank 1 once; the process group stays up between the fits), rank 0 writes
OUT_DIR/MODE.json
  exposed: BatchNorm, dropout drawn with the shared seed, unsynced logging (of the loss, which differs
           across ranks, and of a constant weight, which does not), SGD (no per-parameter step sizes),
           101 samples (padding);
           validation over 101 samples without padding, logged with sync_dist=True (integer count)
  clean:   no BatchNorm, per-rank seed, sync_dist logging, 96 samples, contiguous global-batch sampler
"""

import json
import sys
import warnings

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from vae_ddp.audit import DDPAudit
from vae_ddp.fixes import GlobalBatchDistributedSampler, PerRankSeed
from vae_ddp.fixes.logging import unrepeated_sampler
from vae_ddp.utils import close_process_group, quiet


class Net(pl.LightningModule):
    def __init__(self, batchnorm: bool, sync: bool) -> None:
        super().__init__()
        layers = [nn.Linear(8, 16)] + ([nn.BatchNorm1d(16), nn.Dropout(0.1)] if batchnorm else []) + [
            nn.ReLU(), nn.Linear(16, 1)]
        self.net = nn.Sequential(*layers)
        self.sync = sync

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss, sync_dist=self.sync, batch_size=len(x))
        self.log("kl_weight", 0.5, sync_dist=self.sync, batch_size=len(x))  # the same on every rank
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x).squeeze(-1), y), sync_dist=True, batch_size=len(x))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(out: str, mode: str) -> None:
    pl.seed_everything(0, verbose=False)
    exposed = mode == "exposed"
    n = 101 if exposed else 96
    ds = TensorDataset(torch.randn(n, 8), torch.randn(n))
    audit = DDPAudit()
    callbacks = [audit] if exposed else [PerRankSeed(0), audit]
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, limit_train_batches=2,
                         num_sanity_val_steps=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=exposed, callbacks=callbacks)
    if exposed:
        dl = DataLoader(ds, batch_size=8, shuffle=True)
    else:
        rank = trainer.global_rank
        dl = DataLoader(ds, batch_size=8, sampler=GlobalBatchDistributedSampler(ds, 16, num_replicas=2, rank=rank))
    val = None
    if exposed:  # 51 and 50 samples on the two ranks, no padding
        val_set = TensorDataset(torch.randn(101, 8), torch.randn(101))
        val = DataLoader(val_set, batch_size=16, sampler=unrepeated_sampler(val_set, num_replicas=2,
                                                                            rank=trainer.global_rank))
    trainer.fit(Net(batchnorm=exposed, sync=not exposed), dl, val)
    if trainer.is_global_zero:
        with open(f"{out}/{mode}.json", "w") as f:
            json.dump(audit.state(), f)


def main(out: str, modes: list[str]) -> None:
    quiet()
    warnings.filterwarnings("ignore", message="DDPAudit")
    for mode in modes:
        fit(out, mode)
    close_process_group()  # Lightning leaves the group open after fit; gloo can abort at exit


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
