"""The heartbeat of a Lightning run under a guard (see [`vae_ddp.guard`][vae_ddp.guard]).

The ``Trainer``s this project builds for its own launches (a study's runs,
``vae_ddp.harness.runner.build_trainer``; the audit's runs, ``vae_ddp.audit.run.build``) take
[`callbacks`][vae_ddp.heartbeat.callbacks]: a [`Heartbeat`][vae_ddp.heartbeat.Heartbeat] when the
process runs under a guard, nothing otherwise. So every rank of those runs reports its progress
to the guard's watchdog and dumps its stacks on request. A script of one's own under a guard adds
``callbacks=heartbeat.callbacks()`` to its ``Trainer``. Nothing is registered with Lightning (no
``pytorch_lightning.callbacks_factory`` entry point): installing vae-ddp changes no other
``Trainer``.
"""

from __future__ import annotations

from pytorch_lightning import Callback, LightningModule, Trainer

from vae_ddp.beats import beat, rearm, under_guard

__all__ = ["Heartbeat", "callbacks"]


class Heartbeat(Callback):
    """Touch this process's heartbeat file at setup, at the start of each training epoch, after
    every training and validation batch and at teardown (a no-op outside a guard). The first
    beat also registers the dump of every thread's stack on SIGUSR1 (``faulthandler``), each setup again
    (``beats.rearm``: the previous ``fit`` of the process unregistered it)."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        beat(trainer.global_rank)
        rearm()  # the previous fit's teardown set SIGUSR1 back to its default

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        beat(trainer.global_rank)

    def on_train_batch_end(self, trainer: Trainer, *args) -> None:
        beat(trainer.global_rank, trainer.global_step)

    def on_validation_batch_end(self, trainer: Trainer, *args) -> None:
        beat(trainer.global_rank)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        beat(trainer.global_rank)


def callbacks() -> list[Callback]:
    """``[Heartbeat()]`` under a guard, else ``[]``: the callbacks of a ``Trainer`` this project launches."""
    return [Heartbeat()] if under_guard() else []
