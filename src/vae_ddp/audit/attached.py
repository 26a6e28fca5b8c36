"""A one-device ``Trainer`` for the user's datamodule and module while the audit's pre-checks call their hooks.

Lightning attaches its ``Trainer`` before it calls any hook of either (``trainer.fit`` sets
``datamodule.trainer`` and ``model.trainer``, Lightning 2.x), so a ``train_dataloader()`` that reads
``self.trainer.global_rank`` (to seed its workers by rank, as the audit advises) is a user's everyday code,
not bad input. The pre-checks run in one process: the Trainer is a one-device, CPU one (``global_rank`` 0,
``world_size`` 1), its logging silenced.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

__all__ = ["one_device_trainer", "one_device_view", "LOGGERS"]

#: Lightning's loggers, whose lines about the devices a ``Trainer`` finds are the pre-checks', not the user's.
LOGGERS = ("pytorch_lightning", "lightning_fabric", "lightning.pytorch")


def one_device_trainer(package: str = "pytorch_lightning", **arguments: Any) -> Any:
    """A ``Trainer`` of ``package`` (``pytorch_lightning`` or ``lightning``: ``lightning.pytorch``, the package the
    user's classes are built on) on one CPU (no logger, checkpoints, progress bar or summary; ``arguments``: more of
    its arguments, the user's, which Lightning checks as it builds it), with Lightning's chatter (its device lines,
    its warnings) silenced. Raises what Lightning raises for the arguments."""
    import importlib

    Trainer = importlib.import_module("lightning.pytorch" if package == "lightning" else "pytorch_lightning").Trainer

    loggers = [logging.getLogger(n) for n in LOGGERS]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                           enable_progress_bar=False, enable_model_summary=False, **arguments)
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class _OneDeviceView:
    """A rank's ``Trainer`` as one device's: world size 1, rank 0; every other attribute the trainer's own."""

    world_size = num_devices = num_nodes = 1
    global_rank = local_rank = node_rank = 0
    is_global_zero = True

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)


def one_device_view(trainer: Any) -> Any:
    """``trainer`` (a DDP rank's) as the datamodule that draws one device's global batches in that rank sees it
    (the audit's sampler fix deals them to the ranks): ``world_size`` 1, ``global_rank`` 0, so that a loader built
    from them (a ``DistributedSampler`` of the user's own, ``use_distributed_sampler=False``) draws what one device
    draws; every other attribute is the trainer's."""
    return _OneDeviceView(trainer)
