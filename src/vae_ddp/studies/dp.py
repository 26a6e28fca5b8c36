"""The ``dp`` configuration: DataParallel of Lightning 1.x, on a Lightning 2.x stack.

Lightning 2.0 removed ``strategy="dp"``. Lightning 1.x's ``DataParallelStrategy`` wrapped
the LightningModule in ``torch.nn.DataParallel``: every optimizer step, the global batch
was scattered into ``N`` chunks (``Tensor.chunk`` along dim 0), one per GPU; each replica
ran ``training_step`` on its chunk; the returned losses were gathered to GPU 0 and
averaged (``training_step_end`` default: mean of the replica outputs); one backward ran
through the replicas, so the gradient is the mean of the chunk gradients.

[`DataParallelVAE`][vae_ddp.studies.dp.DataParallelVAE] reproduces that step in two ways:

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
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from vae_ddp.model import VAE

__all__ = ["DataParallelVAE", "DP_MODES", "resolve_dp_mode"]

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
        raise ValueError(f"--dp real needs {replicas} CUDA devices, this machine has {cuda}: "
                         f"use --dp emulate (a single-process emulation of Lightning 1.x DP)")
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
            ``"auto"`` first with [`resolve_dp_mode`][vae_ddp.studies.dp.resolve_dp_mode].
        replica_seed: seed of each replica's noise generator in the emulation.
        **kwargs: passed to [`VAE`][vae_ddp.model.VAE].
    """

    def __init__(self, replicas: int = 2, dp_mode: str = "emulate", replica_seed: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.replicas, self.dp_mode, self.replica_seed = replicas, dp_mode, replica_seed
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
            out = dp(x).mean(0)  # mean of the replica outputs, as Lightning 1.x DP reduced them
        else:
            outs = []
            for i, chunk in enumerate(x.chunk(self.replicas)):
                with self._replica(i):
                    _, logs = self.step(chunk)
                outs.append(torch.stack([logs["loss"], logs["recon_loss"], logs["kl"]]))
            out = torch.stack(outs).mean(0)
        loss, recon, kl = out[0], out[1], out[2]
        self.last_logs = {"loss": loss.detach(), "recon_loss": recon.detach(), "kl": kl.detach(),
                          "batch_size": torch.tensor(float(len(x)), dtype=loss.dtype, device=loss.device)}
        self.log_dict({"train_loss": loss, "train_recon_loss": recon, "train_kl": kl}, on_step=True,
                      on_epoch=False, batch_size=len(x))
        return loss
