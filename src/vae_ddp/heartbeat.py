"""The heartbeat of a Lightning run under a guard (see [`vae_ddp.guard`][vae_ddp.guard]).

Lightning adds the callbacks that ``pytorch_lightning.callbacks_factory`` entry points return
to every ``Trainer`` (``_configure_external_callbacks`` in Lightning 2.x's callback
connector); this package registers [`callbacks`][vae_ddp.heartbeat.callbacks], which returns a
[`Heartbeat`][vae_ddp.heartbeat.Heartbeat] when the process runs under a guard and nothing otherwise.
So every rank of every run the project launches (studies, audit, examples, tests) reports
its progress to the guard's watchdog and dumps its stacks on request, without a line in the
training script.
"""

from __future__ import annotations

import logging

from pytorch_lightning import Callback, LightningModule, Trainer

from vae_ddp.guard import beat, under_guard

__all__ = ["Heartbeat", "callbacks"]


class Heartbeat(Callback):
    """Touch this process's heartbeat file at setup, at the start of each training epoch, after
    every training and validation batch and at teardown (a no-op outside a guard). The first
    beat also registers the dump of every thread's stack on SIGUSR1 (``faulthandler``)."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        beat(trainer.global_rank)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        beat(trainer.global_rank)

    def on_train_batch_end(self, trainer: Trainer, *args) -> None:
        beat(trainer.global_rank, trainer.global_step)

    def on_validation_batch_end(self, trainer: Trainer, *args) -> None:
        beat(trainer.global_rank)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        beat(trainer.global_rank)


class _QuietAddition(logging.Filter):
    """Drops Lightning's "Adding 1 callbacks from entry point ..." line for this entry point:
    the heartbeat is plumbing, not part of the run a reader sees."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "vae_ddp_heartbeat" not in record.getMessage()


def callbacks() -> list[Callback]:
    """Lightning's external-callback factory: ``[Heartbeat()]`` under a guard, else ``[]``."""
    if not under_guard():
        return []
    logger = logging.getLogger("lightning_fabric.utilities.registry")
    if not any(isinstance(f, _QuietAddition) for f in logger.filters):
        logger.addFilter(_QuietAddition())
    return [Heartbeat()]
