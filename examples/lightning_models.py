"""A module and datamodule written as Lightning's current documentation writes them (`import lightning as L`,
`L.LightningModule`): `examples/audit_models.py`'s `Plain` and `Regression` on the `lightning` package. The
audit runs them with `lightning.pytorch`'s own Trainer (a Trainer of `pytorch_lightning` refuses them):

    vae-ddp audit --model examples/lightning_models.py:Plain --data examples/lightning_models.py:Regression
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningDataModule):
    """`n` samples of a fixed random regression task (`x: (n, 8)` float32, `y: (n,)`)."""

    def __init__(self, batch_size: int = 16, n: int = 64) -> None:
        super().__init__()
        self.batch_size, self.n = batch_size, n

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(self.n, 8, generator=g)
        self.train_set = TensorDataset(x, x @ torch.randn(8, generator=g) + 0.1 * torch.randn(self.n, generator=g))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)


class Plain(L.LightningModule):
    """A small regression network; its loss logged with `sync_dist=True`."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(x))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)
