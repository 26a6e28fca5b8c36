"""Measurement callbacks: what each rank drew and what the optimizer received.

They observe a run without changing it, so the factor examples can show a mechanism on a
real Lightning DDP run (gloo on CPU) and compare it with a one-process reference.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from pytorch_lightning import Callback, LightningModule, Trainer
from torch import Tensor

__all__ = ["NoiseProbe", "GradientProbe"]


class NoiseProbe(Callback):
    """Record the reparameterization noise ``eps`` each rank draws in each training step.

    Put it after any callback that replaces ``pl_module.noise`` (e.g.
    [`GlobalBatchNoise`][vae_ddp.fixes.noise.GlobalBatchNoise]): it wraps whatever is there at
    ``on_train_batch_start``. At the end of training the draws are gathered from all ranks.

    Attributes:
        gathered: ``(world_size, steps, b, latent_dim)`` tensor on every rank after
            ``fit`` (``trainer.strategy.all_gather``), where ``b`` is the per-device batch.
    """

    def __init__(self) -> None:
        self._draws: list[Tensor] = []
        self.gathered: Optional[Tensor] = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        inner = pl_module.noise

        def recording(mu: Tensor) -> Tensor:
            eps = inner(mu)
            self._draws.append(eps.detach().clone())
            return eps

        pl_module.noise = recording
        self._inner = inner

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        pl_module.noise = self._inner

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        local = torch.stack(self._draws)
        g = trainer.strategy.all_gather(local)
        self.gathered = g if trainer.world_size > 1 else g.unsqueeze(0)


class GradientProbe(Callback):
    """Keep the gradients the optimizer receives at optimizer step ``step`` (0-based).

    Under ``strategy="ddp"`` the gradients have been all-reduced (averaged over ranks) by
    DistributedDataParallel during ``backward``, so ``on_before_optimizer_step`` sees what
    every rank's Adam sees. Also keeps the parameters before that step.

    Attributes:
        grads: ``{name: Tensor}`` (detached copies) after ``fit``; None if the run was shorter.
        params: ``{name: Tensor}`` before the step.
    """

    def __init__(self, step: int = 0) -> None:
        self.step = step
        self.grads: Optional[dict[str, Tensor]] = None
        self.params: Optional[dict[str, Tensor]] = None

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        if trainer.global_step == self.step:
            self.grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None}
            self.params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
