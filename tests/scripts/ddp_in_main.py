"""A user's script whose classes live in ``__main__``: the audit's runs import them from this file
(``path/to/file.py:Class``), under a module name of their own, so the work below the
``if __name__ == "__main__":`` guard does not run again there. Prints the class path the audit
used and the exit code."""

import torch
from pytorch_lightning import LightningDataModule, LightningModule
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


class Data(LightningDataModule):
    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=g)
        self.train_set = TensorDataset(x, x.sum(1, keepdim=True))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=False)


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    from vae_ddp.testing import assert_ddp_matches_one_device

    result = assert_ddp_matches_one_device(Net(), Data, steps=2, effect_batches=0)
    print(result.to_dict()["model_name"], result.exit_code)
