"""BatchNorm statistics of the global batch, on CPU/gloo as well as on GPUs.

Under DDP each rank's ``nn.BatchNorm2d`` normalises with the mean and variance of its own
``B/N`` samples, not of the global batch of ``B`` (Lightning 1.x DP did the same per
replica). On GPUs the fix is Lightning's own ``Trainer(sync_batchnorm=True)``, which
converts the layers to ``torch.nn.SyncBatchNorm``. torch's SyncBatchNorm refuses CPU
tensors (torch 2.x: its forward raises inside a process group and DDP's constructor
raises "SyncBatchNorm layers only work with GPU modules"), so on CPU/gloo use
[`GlooSyncBatchNorm`][vae_ddp.fixes.batchnorm.GlooSyncBatchNorm], a Lightning ``LayerSync`` plugin with the same role::

    Trainer(accelerator="cpu", devices=2, strategy="ddp", plugins=[GlooSyncBatchNorm()])
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from pytorch_lightning.plugins import LayerSync
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["GlobalBatchNorm", "GlooSyncBatchNorm"]

# torch 2.x marks the autograd-aware collectives deprecated in favour of a private module
# (torch.distributed._functional_collectives); the public one is still the documented API.
# The warning is silenced around our own calls only (no process-wide filter).
_DEPRECATED = r"torch\.distributed\.nn\.functional\.all_reduce is deprecated"


def _all_reduce_autograd(t: Tensor) -> Tensor:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEPRECATED)
        return dist_fn.all_reduce(t)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class GlobalBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are those of the global batch across all ranks.

    In training mode with a process group of world size > 1, the per-channel mean and
    (biased) variance are computed over every rank's samples with two autograd-aware
    sum all-reduces (``torch.distributed.nn.functional.all_reduce``: its backward
    all-reduces the incoming gradients, so gradients also flow across ranks), on any
    backend, gloo included. Running statistics are updated as ``nn.BatchNorm`` does
    (momentum, unbiased variance with the global count). Otherwise (eval mode, or no
    process group) it is plain ``torch.nn.functional.batch_norm``.

    Input: ``(B, C)``, ``(B, C, L)``, ``(B, C, H, W)`` or ``(B, C, D, H, W)``.
    Assumes every rank takes part in every forward (as DDP does).
    """

    def _check_input_dim(self, x: Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: Tensor) -> Tensor:
        self._check_input_dim(x)
        if not self.training or _world_size() == 1:
            return super().forward(x)
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        local_n = x.numel() // x.shape[1]
        count = torch.tensor([float(local_n)], dtype=x.dtype, device=x.device)
        dist.all_reduce(count)  # no gradient needed for the global count
        n = count[0]
        mean = _all_reduce_autograd(x.sum(dims)) / n
        centered = x - mean.view(shape)
        var = _all_reduce_autograd((centered * centered).sum(dims)) / n
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = (1.0 / float(self.num_batches_tracked)) if self.momentum is None else self.momentum
                self.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
                self.running_var.mul_(1 - factor).add_(var.detach() * (n / (n - 1)), alpha=factor)
        y = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        """Return ``module`` with every ``_BatchNorm`` (not already global) replaced by a
        [`GlobalBatchNorm`][vae_ddp.fixes.batchnorm.GlobalBatchNorm] sharing its parameters and buffers (as
        ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` does)."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            out = _swap(module, cls)
            out.original_cls = type(module)
        for name, child in module.named_children():
            out.add_module(name, cls.convert(child))
        return out

    @staticmethod
    def revert(module: nn.Module) -> nn.Module:
        """Inverse of `convert`: each [`GlobalBatchNorm`][vae_ddp.fixes.batchnorm.GlobalBatchNorm] back to the class it
        replaced (``nn.BatchNorm2d`` if it was built directly), sharing parameters and buffers."""
        out = module
        if isinstance(module, GlobalBatchNorm):
            out = _swap(module, getattr(module, "original_cls", nn.BatchNorm2d))
        for name, child in module.named_children():
            out.add_module(name, GlobalBatchNorm.revert(child))
        return out


def _swap(module: _BatchNorm, new_cls: type) -> _BatchNorm:
    """A ``new_cls`` BatchNorm with ``module``'s settings, sharing its parameters and buffers."""
    out = new_cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
    if module.affine:
        out.weight, out.bias = module.weight, module.bias
    if module.track_running_stats:
        out.running_mean, out.running_var = module.running_mean, module.running_var
        out.num_batches_tracked = module.num_batches_tracked
    out.train(module.training)
    return out


class GlooSyncBatchNorm(LayerSync):
    """Lightning ``LayerSync`` plugin: ``Trainer(plugins=[GlooSyncBatchNorm()])``.

    Lightning's DDP strategy calls ``apply`` on the LightningModule before wrapping it in
    ``DistributedDataParallel`` (the same hook ``sync_batchnorm=True`` uses with
    ``TorchSyncBatchNorm``), which converts every BatchNorm into [`GlobalBatchNorm`][vae_ddp.fixes.batchnorm.GlobalBatchNorm].
    On GPUs prefer ``Trainer(sync_batchnorm=True)``.
    """

    def apply(self, model: nn.Module) -> nn.Module:
        return GlobalBatchNorm.convert(model)

    def revert(self, model: nn.Module) -> nn.Module:
        return GlobalBatchNorm.revert(model)
