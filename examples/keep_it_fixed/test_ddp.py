"""A user's test file: DDP on 2 CPU processes (gloo) must train the model one device trains.

The model below once had a BatchNorm layer, whose per-rank statistics made DDP train another
model than one device (the audit named it); it now normalises with LayerNorm. This test fails,
naming the cause, its effect, its fix and its page, the day a change brings such a difference
back. Run it as any test: `pytest tests/test_ddp.py`.
"""

import pytest
import torch
from pytorch_lightning import LightningDataModule, LightningModule
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from vae_ddp.testing import assert_ddp_matches_one_device


class Digits(LightningDataModule):
    """scikit-learn's 8x8 digits (bundled with it: nothing to download); `batch_size` is the global batch."""

    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16
        self.train_set = TensorDataset(x, torch.tensor(digits.target))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)


class Classifier(LightningModule):
    def __init__(self, hidden: int = 32, norm: str = "layer") -> None:
        super().__init__()
        self.save_hyperparameters()
        layer = nn.LayerNorm(hidden) if norm == "layer" else nn.BatchNorm1d(hidden)
        self.net = nn.Sequential(nn.Linear(64, hidden), layer, nn.ReLU(), nn.Linear(hidden, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.timeout(600)
def test_ddp_trains_the_one_device_model():
    assert_ddp_matches_one_device(Classifier, Digits, model_args={"norm": "layer"}, data_args={"batch_size": 32})
