"""Measurement callbacks: what each rank drew and what the optimizer received.

They observe a run without changing it, so the factor examples can show a mechanism on a
real Lightning DDP run (gloo on CPU) and compare it with a one-process reference.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from pytorch_lightning import Callback, LightningModule, Trainer
from torch import Tensor

__all__ = ["NoiseProbe", "GradientProbe", "StepProbe", "relative_difference", "per_step_differences"]


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


class StepProbe(Callback):
    """Every optimizer step's gradient, optionally from weights forced to another run's.

    Recording (``states=None``): at the start of step ``k`` keep the module's state (parameters
    and buffers, the weights θ_k), and before the optimizer steps keep the gradient it receives
    (all-reduced over ranks under ``strategy="ddp"``) and the BatchNorm buffers the step's
    forward left. Teacher forcing (``states`` = the ``states`` another run recorded): at the
    start of step ``k`` load θ_k into the module first, on every rank alike, so the step starts
    from the reference run's weights and its gradient differs from the reference's only by
    what this run computes differently (grouping over ranks, order of the samples), never by
    differences carried over from earlier steps. The optimizer still steps, but its result is
    replaced at the next step. With ``lag`` L, batch ``k >= L`` starts from θ_(k-L) instead
    (batches ``k < L`` from θ_k): another batch at the same weights, the batch-to-batch
    gradient noise one device has at the reference's weights.

    ``k`` counts training batches; the gradients are kept at every optimizer step: one per
    batch under automatic optimization, one per ``accumulate_grad_batches`` batches with
    accumulation, two per batch for a manual-optimization module that steps two optimizers (a
    GAN), in both runs alike.

    Args:
        states: the reference's ``{name: Tensor}`` per step, or None to record them.
        record_states: keep θ_k of each step (the reference run).
        lag: forced runs only: batches later than the weights they start from (0: the same batch).

    Attributes:
        grads: per step, the gradient as one float64 vector ``(P,)`` (parameters in
            ``named_parameters`` order, those without a gradient left out).
        buffers: per step, the floating-point buffers as one float64 vector (empty without BatchNorm).
        states: the θ_k loaded or recorded, per step.
        loaded: forced runs: per batch, the index k of the θ_k it started from.
        grad_batches: per kept gradient, the training batch (0, 1, ...) it was computed on.

    Raises:
        RuntimeError: a forced run that has more steps than the reference recorded.
    """

    def __init__(self, states: Optional[list[dict[str, Tensor]]] = None, record_states: bool = False,
                 lag: int = 0) -> None:
        self.forced = states is not None
        self.lag = lag
        self.states: list[dict[str, Tensor]] = list(states) if states is not None else []
        self.record_states = record_states and not self.forced
        self.grads: list[Tensor] = []
        self.buffers: list[Tensor] = []
        self.loaded: list[int] = []
        self.grad_batches: list[int] = []
        self._batch = 0

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._batch = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # counted per training batch, not by `global_step`: with manual optimization and two
        # optimizers, Lightning counts two steps per batch
        k = self._batch
        self._batch += 1
        if self.forced:
            if k >= len(self.states):
                raise RuntimeError(f"StepProbe: batch {k} is past the {len(self.states)} batches of the reference")
            own = pl_module.state_dict()
            self.loaded.append(k - self.lag if k >= self.lag else k)
            with torch.no_grad():
                for name, value in self.states[self.loaded[-1]].items():
                    if name in own:
                        own[name].copy_(value.to(own[name].device, own[name].dtype))
        elif self.record_states:
            self.states.append({n: t.detach().cpu().clone() for n, t in pl_module.state_dict().items()})

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        grads = [p.grad.detach().reshape(-1).double().cpu() for _, p in pl_module.named_parameters() if p.grad is not None]
        self.grads.append(torch.cat(grads) if grads else torch.zeros(0, dtype=torch.float64))
        self.grad_batches.append(self._batch - 1)
        bufs = [b.detach().reshape(-1).double().cpu() for _, b in pl_module.named_buffers() if b.is_floating_point()]
        self.buffers.append(torch.cat(bufs) if bufs else torch.zeros(0, dtype=torch.float64))


def relative_difference(a: Tensor, b: Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (0.0 when both are zero; ``inf`` when only ``b`` is)."""
    a, b = a.double(), b.double()
    nb = float(b.norm())
    d = float((a - b).norm())
    if nb == 0:
        return 0.0 if d == 0 else float("inf")
    return d / nb


def per_step_differences(steps: list[Tensor], reference: list[Tensor]) -> list[float]:
    """[`relative_difference`][vae_ddp.probes.relative_difference] of each step's tensor
    (``StepProbe.grads`` or ``.buffers``: one flat float64 tensor per optimizer step) against
    the same step of ``reference`` (0.0 for a step with an empty reference, e.g. no buffers).

    Raises:
        ValueError: the two records hold different numbers of steps.
    """
    if len(steps) != len(reference):
        raise ValueError(f"{len(steps)} steps compared with a reference of {len(reference)}")
    return [relative_difference(a, b) if b.numel() else 0.0 for a, b in zip(steps, reference)]
