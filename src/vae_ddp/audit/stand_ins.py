"""What the audit's parser sees in place of an instance the Python API was given (``vae_ddp.audit.user_objects``):
the parser checks a class and its init arguments, an instance has neither to show it (its class may take
arguments it does not keep). The runs never build these: they start from a copy of the instance."""

from __future__ import annotations

from pytorch_lightning import LightningDataModule, LightningModule

__all__ = ["GivenModule", "GivenDataModule"]


class GivenModule(LightningModule):
    """The parser's stand-in for a ``LightningModule`` instance."""


class GivenDataModule(LightningDataModule):
    """The parser's stand-in for a ``LightningDataModule`` instance (its ``batch_size``, as the parser asks)."""

    def __init__(self, batch_size: int = 1) -> None:
        super().__init__()
        self.batch_size = batch_size
