"""Small LightningModules whose DDP gradient differs from one device's by a bug no automatic fix
closes (issue #48, item 3), each with its corrected variant; plain Lightning, no vae_ddp.

- ``HeadOverRanks`` / ``HeadOverRanksFixed``: manual optimisation, two optimizers (the trunk's and
  the head's), the head's loss divided by ``self.trainer.world_size`` ("each rank holds 1/N of the
  batch"): the head's gradient under DDP is exactly 1/N of one device's.
- ``PlainBackward`` / ``PlainBackwardFixed``: manual optimisation with ``loss.backward()``: Lightning
  prepares DDP's reducer only in ``self.manual_backward``, so the ranks' gradients are never averaged.
- ``UngradGather`` / ``UngradGatherFixed``: a two-view contrastive loss whose keys are
  ``self.all_gather(k)`` without ``sync_grads=True``: no gradient flows through the gathered keys.

``Rows`` is the data (64 samples, ``x: (64, 6)``, ``y: (64,)``; ``batch_size`` the global batch).
"""

from __future__ import annotations

import torch
from pytorch_lightning import LightningDataModule, LightningModule
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


class Rows(LightningDataModule):
    def __init__(self, batch_size: int = 16, n: int = 64, shuffle: bool = False) -> None:
        super().__init__()
        self.batch_size, self.n, self.shuffle = batch_size, n, shuffle

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(99)
        x = torch.randn(self.n, 6, generator=g)
        y = torch.sin(x[:, 0]) + x[:, 1] * x[:, 2] + 0.05 * torch.randn(self.n, generator=g)
        self.train_set = TensorDataset(x, y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle)


class HeadOverRanks(LightningModule):
    """Trunk and head stepped by their own optimizers, each on its own loss; the head's loss divided
    by the world size."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.trunk = nn.Sequential(nn.Linear(6, 12), nn.ReLU())
        self.head = nn.Linear(12, 1)

    def forward(self, x):
        return self.head(self.trunk(x)).squeeze(-1)

    def head_loss(self, x, y):
        return F.smooth_l1_loss(self(x), y) / self.trainer.world_size

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_trunk, opt_head = self.optimizers()
        opt_trunk.zero_grad()
        self.manual_backward(F.mse_loss(self(x), y))
        opt_trunk.step()
        opt_head.zero_grad()
        self.manual_backward(self.head_loss(x, y))
        opt_head.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.trunk.parameters(), lr=0.05), torch.optim.Adam(self.head.parameters(), lr=1e-2)


class HeadOverRanksFixed(HeadOverRanks):
    def head_loss(self, x, y):
        return F.smooth_l1_loss(self(x), y)


class PlainBackward(LightningModule):
    """Manual optimisation, one optimizer, the backward called on the loss itself."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)

    def backward_of(self, loss):
        loss.backward()

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        self.backward_of(F.mse_loss(self(x), y))
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.05, momentum=0.9)


class PlainBackwardFixed(PlainBackward):
    def backward_of(self, loss):
        self.manual_backward(loss)


class UngradGather(LightningModule):
    """Two views of each row (the row and its features reversed), queries of the rank's rows
    against the keys of the global batch."""

    sync_grads = False

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        x, _ = batch
        q = F.normalize(self.encoder(x), dim=-1)  # (b, 4)
        k = F.normalize(self.encoder(x.flip(-1)), dim=-1)
        keys = self.all_gather(k, sync_grads=self.sync_grads)  # (N, b, 4) under DDP; k itself on one device
        keys = keys.reshape(-1, k.shape[-1])
        target = torch.arange(len(q), device=q.device) + self.global_rank * len(q)
        return F.cross_entropy(q @ keys.T / 0.2, target)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class UngradGatherFixed(UngradGather):
    sync_grads = True
