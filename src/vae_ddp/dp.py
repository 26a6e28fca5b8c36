"""The ``dp`` configuration: DataParallel of Lightning 1.x, on a Lightning 2.x stack.

Lightning 2.0 removed ``strategy="dp"``. Lightning 1.x's ``DataParallelStrategy`` wrapped
the LightningModule in ``torch.nn.DataParallel``: every optimizer step, the global batch
was scattered into ``N`` chunks (``Tensor.chunk`` along dim 0), one per GPU; each replica
ran ``training_step`` on its chunk; the returned losses were gathered to GPU 0 and
averaged (``training_step_end`` default: mean of the replica outputs); one backward ran
through the replicas, so the gradient is the mean of the chunk gradients.

[`DataParallelVAE`][vae_ddp.dp.DataParallelVAE] reproduces that step in two ways:

- ``mode="real"`` (needs >= 2 CUDA devices): the real ``torch.nn.DataParallel`` over the
  first ``replicas`` GPUs.
- ``mode="emulate"`` (any machine, CPU included; a clearly labelled emulation): the same
  arithmetic in one process, chunk after chunk. What it reproduces: the chunking, the
  per-chunk BatchNorm statistics (each replica normalises with its own chunk), running
  statistics updated from chunk 0 only (DataParallel keeps only device[0]'s buffer
  updates, torch docs of ``nn.DataParallel``), reparameterization noise drawn per replica
  from its own generator, all seeded alike (``seed_everything`` -> ``torch.manual_seed``
  seeds every CUDA device's generator, so each replica draws the same ``eps`` rows), and
  the mean of the replica losses. What it cannot reproduce: the GPU kernels' own rounding
  and non-determinism, the inter-GPU copies, timing, and any per-device state other
  than the noise generator and BatchNorm buffers. That replica noise coincides across
  devices is inferred from how torch seeds CUDA generators, not observed on GPUs here.

What Lightning 1.x DP *logged* (``self.log(..., on_step=True)``, no ``sync_dist``, as
bolts' VAE does) was one replica's value, not the mean over replicas, read from the
source: every replica is a shallow copy of the LightningModule (torch's
``Module._replicate_for_data_parallel`` copies ``__dict__``), so all replicas log into the
same result object and each call overwrites the last one (Lightning 1.2.6:
``training_loop.training_step`` sets ``model._results = Result()`` before the DP forward and
``Result.log`` stores with ``__setitem__``; Lightning 1.9.5: ``_ResultMetric.update`` sets
``_forward_cache`` for ``on_step`` values, and ``LightningModule.log`` passes on
``sync_dist and _distributed_available()``, false under DP, which starts no process
group). Which replica writes last depends on thread scheduling; the emulation logs the last
replica's value (``logged_replica``), a half batch, as DDP's rank 0 does. The *loss* that is optimised is
the mean over replicas (``training_step_end``'s default reduction).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from vae_ddp.model import VAE

__all__ = ["DP_MODES", "DataParallelVAE", "resolve_dp_mode"]

DP_MODES = ("auto", "real", "emulate")


def resolve_dp_mode(mode: str, replicas: int) -> str:
    """``"auto"`` -> ``"real"`` with >= ``replicas`` CUDA devices, else ``"emulate"``.

    Raises:
        ValueError: ``"real"`` asked for with fewer CUDA devices, or an unknown mode.
    """
    if mode not in DP_MODES:
        raise ValueError(f"unknown dp mode {mode!r}: use one of {', '.join(DP_MODES)}")
    cuda = torch.cuda.device_count()
    if mode == "auto":
        return "real" if cuda >= replicas else "emulate"
    if mode == "real" and cuda < replicas:
        raise ValueError(f"dp_mode='real' needs {replicas} CUDA devices, this machine has {cuda}: "
                         f"use dp_mode='emulate' (a single-process emulation of Lightning 1.x DP)")
    return mode


class _Replica(nn.Module):
    """What one DataParallel replica computes: the stacked ``(loss, recon_loss, kl)``."""

    def __init__(self, vae: VAE) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, x: Tensor) -> Tensor:
        _, logs = self.vae.step(x)
        return torch.stack([logs["loss"], logs["recon_loss"], logs["kl"]]).unsqueeze(0)  # (1, 3)


class DataParallelVAE(VAE):
    """[`VAE`][vae_ddp.model.VAE] whose training step is Lightning 1.x DP's.

    Args:
        replicas: number of DataParallel replicas (GPUs) N; the batch is the global batch.
        dp_mode: ``"real"`` or ``"emulate"`` (see the module docstring); resolve
            ``"auto"`` first with [`resolve_dp_mode`][vae_ddp.dp.resolve_dp_mode].
        replica_seed: seed of each replica's noise generator in the emulation.
        logged_replica: whose values ``self.log`` shows (see the module docstring): the
            index of a replica (default -1: the last), or ``None`` for the mean over
            replicas (the global-batch value, which Lightning 1.x DP did not log).
        **kwargs: passed to [`VAE`][vae_ddp.model.VAE].
    """

    def __init__(self, replicas: int = 2, dp_mode: str = "emulate", replica_seed: int = 0,
                 logged_replica: int | None = -1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.replicas, self.dp_mode, self.replica_seed = replicas, dp_mode, replica_seed
        self.logged_replica = logged_replica
        self._gens: list[torch.Generator] = []

    def on_fit_start(self) -> None:
        self._gens = []
        for _ in range(self.replicas):
            g = torch.Generator(device=self.device)
            g.manual_seed(self.replica_seed)
            self._gens.append(g)

    @contextmanager
    def _replica(self, i: int) -> Iterator[None]:
        """Replica i's view: its own noise generator; BatchNorm buffer updates kept only for i == 0."""
        saved_noise = self.noise
        self.noise = lambda mu: torch.randn(mu.shape, generator=self._gens[i], dtype=mu.dtype, device=mu.device)
        bns = [m for m in self.modules() if isinstance(m, _BatchNorm)] if i else []
        names = ("running_mean", "running_var", "num_batches_tracked")
        originals = [[getattr(m, n) for n in names] for m in bns]
        for m in bns:  # replica i > 0 updates copies, which are then dropped
            for n in names:
                setattr(m, n, getattr(m, n).clone())
        try:
            yield
        finally:
            self.noise = saved_noise
            for m, bufs in zip(bns, originals):
                for n, b in zip(names, bufs):
                    setattr(m, n, b)

    def training_step(self, batch, batch_idx):
        x = batch[0]
        if self.dp_mode == "real":
            dp = nn.DataParallel(_Replica(self), device_ids=list(range(self.replicas)))
            per_replica = dp(x)  # (replicas, 3)
        else:
            outs = []
            for i, chunk in enumerate(x.chunk(self.replicas)):
                with self._replica(i):
                    _, logs = self.step(chunk)
                outs.append(torch.stack([logs["loss"], logs["recon_loss"], logs["kl"]]))
            per_replica = torch.stack(outs)
        out = per_replica.mean(0)  # mean of the replica outputs, as Lightning 1.x DP reduced the loss
        loss, recon, kl = out[0], out[1], out[2]
        self.last_logs = {"loss": loss.detach(), "recon_loss": recon.detach(), "kl": kl.detach(),
                          "batch_size": torch.tensor(float(len(x)), dtype=loss.dtype, device=loss.device)}
        shown = out if self.logged_replica is None else per_replica[self.logged_replica]
        self.log_dict({"train_loss": shown[0], "train_recon_loss": shown[1], "train_kl": shown[2]}, on_step=True,
                      on_epoch=False, batch_size=len(x) // (1 if self.logged_replica is None else self.replicas))
        return loss
