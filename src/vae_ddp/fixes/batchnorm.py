"""BatchNorm statistics of the global batch, on any device and process-group backend.

Under DDP each rank's ``nn.BatchNorm2d`` normalises with the mean and variance of its own
``B/N`` samples, not of the global batch of ``B`` (Lightning 1.x DP did the same per
replica). On GPUs the fix is Lightning's own ``Trainer(sync_batchnorm=True)``, which
converts the layers to ``torch.nn.SyncBatchNorm``. torch's SyncBatchNorm refuses CPU
tensors (torch 2.x: its kernels ``batch_norm_stats``/``batch_norm_elemt`` exist for CUDA only,
and DDP's constructor raises "SyncBatchNorm layers only work with GPU modules"), so on
CPU (gloo) use [`GlobalSyncBatchNorm`][vae_ddp.fixes.batchnorm.GlobalSyncBatchNorm], a
Lightning ``LayerSync`` plugin with the same role:
``Trainer(accelerator="cpu", devices=2, strategy="ddp", plugins=[GlobalSyncBatchNorm()])``.
Nothing in it is specific to gloo or to CPUs: it uses one ``all_gather`` per layer forward
and one ``all_reduce`` per layer backward, which every backend has.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from pytorch_lightning.plugins import LayerSync
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from vae_ddp.fixes.factor import Factor, Finding, FixParts, Seen, world

__all__ = ["GlobalBatchNorm", "GlobalSyncBatchNorm", "FACTOR"]


def _world_size(group) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


@torch.no_grad()
def _global_stats(x: Tensor, group) -> tuple[Tensor, Tensor, float]:
    """Mean and biased variance per channel over every rank's ``x``, and the global count.

    Each rank computes its count, mean and variance (one fused pass,
    ``torch.batch_norm_update_stats``); one ``all_gather`` of ``[count, mean, var]`` (``2C + 1``
    numbers) brings every rank's; they are combined exactly in float64 (Chan, Golub & LeVeque's
    pairwise update, the combination torch's SyncBatchNorm makes with
    ``batch_norm_gather_stats_with_counts``). Summing ``x`` and ``x**2`` instead would cancel
    catastrophically when ``|mean| >> std``.
    """
    c = x.shape[1]
    n = x.numel() // c
    if n > 0:
        mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)
    else:  # an empty local batch contributes nothing
        mean = var = x.new_zeros(c)
    local = torch.cat([x.new_full((1,), float(n)), mean, var]).to(torch.float64)
    gathered = [torch.empty_like(local) for _ in range(_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    stats = torch.stack(gathered)                      # (world, 2C + 1)
    counts, means, variances = stats[:, :1], stats[:, 1:c + 1], stats[:, c + 1:]
    total = float(counts.sum())
    if total == 0:
        raise ValueError("GlobalBatchNorm: the global batch is empty on every rank")
    g_mean = (counts * means).sum(0) / total
    g_var = (counts * (variances + (means - g_mean) ** 2)).sum(0) / total
    return g_mean.to(x.dtype), g_var.to(x.dtype), total


class _GlobalBatchNormFn(torch.autograd.Function):
    """Batch normalisation with given global statistics; backward all-reduces the two
    per-channel sums the input gradient needs (``sum dy`` and ``sum dy * x_hat``) in one call,
    as ``torch.nn.modules._functions.SyncBatchNorm.backward`` does."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, var, eps, total, group):
        ctx.save_for_backward(x, weight, mean, var)
        ctx.eps, ctx.total, ctx.group = eps, total, group
        return torch.nn.functional.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, var = ctx.saved_tensors
        dy = dy.contiguous(memory_format=_memory_format(x))
        # One fused pass: dy * w * invstd, sum(dy * x_hat), sum(dy) (the eval-mode backward).
        w = weight if weight is not None else torch.ones_like(mean)
        grad_local, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
            dy, x, w, mean, var, None, None, False, ctx.eps, [True, True, True])
        grad_x = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_xhat])
            dist.all_reduce(sums, group=ctx.group)
            c = mean.numel()
            g_dy, g_dy_xhat = sums[:c], sums[c:]
            invstd = torch.rsqrt(var + ctx.eps)
            k = w * invstd / ctx.total
            # dx = dy*w*invstd - k*(sum_dy + x_hat*sum_dy_xhat), x_hat = (x - mean)*invstd
            slope = k * invstd * g_dy_xhat
            offset = k * g_dy - slope * mean
            shape = [1, -1] + [1] * (x.dim() - 2)
            grad_x = grad_local.addcmul_(x, slope.view(shape), value=-1.0).sub_(offset.view(shape))
        grad_w = sum_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = sum_dy if ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None, None, None


def _memory_format(x: Tensor) -> torch.memory_format:
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


class GlobalBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are those of the global batch across all ranks.

    In training mode with a process group of world size > 1, the per-channel mean and
    biased variance are those of the samples of every rank (one ``all_gather`` of each
    rank's count, mean and variance, combined in float64), and the backward pass all-reduces
    the two per-channel gradient sums the input gradient depends on (one ``all_reduce``), so
    the input gradient is that of BatchNorm over the concatenated batch. The gradients of
    ``weight`` and ``bias`` stay local: DDP averages them with the other parameters (as with
    ``torch.nn.SyncBatchNorm``). Running statistics are updated as ``nn.BatchNorm`` does
    (``momentum``, or the cumulative average when ``momentum=None``; unbiased variance with
    the global count). Otherwise (eval mode, or no process group, or world size 1) it is
    ``nn.BatchNorm``'s forward; like ``torch.nn.SyncBatchNorm``, eval mode does not
    synchronise even with ``track_running_stats=False``.

    Input: ``(B, C)``, ``(B, C, L)``, ``(B, C, H, W)`` (contiguous or channels-last) or
    ``(B, C, D, H, W)``; any floating dtype. Every rank must call every layer the same number
    of times (as DDP does); the per-rank batch sizes may differ.

    Args:
        num_features: channels ``C``, as ``nn.BatchNorm2d``.
        eps: added to the variance, as ``nn.BatchNorm2d``.
        momentum: running-statistics factor; ``None``: cumulative average, as ``nn.BatchNorm2d``.
        affine: learn ``weight`` and ``bias``, as ``nn.BatchNorm2d``.
        track_running_stats: keep running statistics, as ``nn.BatchNorm2d``.
        process_group: the ranks to synchronise over (``None``: all of them).
        device: as ``nn.BatchNorm2d``.
        dtype: as ``nn.BatchNorm2d``.

    Raises:
        ValueError: input with fewer than 2 dimensions, or an empty global batch.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group=None,
                 device=None, dtype=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, x: Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: Tensor) -> Tensor:
        self._check_input_dim(x)
        if not self.training or _world_size(self.process_group) == 1:
            return super().forward(x)
        mean, var, total = _global_stats(x, self.process_group)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                unbiased = var * (total / (total - 1)) if total > 1 else var
                self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
        return _GlobalBatchNormFn.apply(x, self.weight, self.bias, mean, var, self.eps, total, self.process_group)

    @classmethod
    def convert(cls, module: nn.Module, process_group=None) -> nn.Module:
        """Return ``module`` with every ``_BatchNorm`` (not already global) replaced by a
        [`GlobalBatchNorm`][vae_ddp.fixes.batchnorm.GlobalBatchNorm] sharing its parameters and buffers (as
        ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` does)."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            out = _swap(module, cls)
            out.process_group = process_group
            out.original_cls = type(module)
        for name, child in module.named_children():
            out.add_module(name, cls.convert(child, process_group))
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


class GlobalSyncBatchNorm(LayerSync):
    """Lightning ``LayerSync`` plugin: ``Trainer(plugins=[GlobalSyncBatchNorm()])``.

    Lightning's DDP strategy calls ``apply`` on the LightningModule before wrapping it in
    ``DistributedDataParallel`` (the same hook ``sync_batchnorm=True`` uses with
    ``TorchSyncBatchNorm``), which converts every BatchNorm into
    [`GlobalBatchNorm`][vae_ddp.fixes.batchnorm.GlobalBatchNorm]. Works on any backend
    (gloo on CPUs included); on GPUs ``Trainer(sync_batchnorm=True)`` does the same with
    torch's fused CUDA kernels.
    """

    def apply(self, model: nn.Module) -> nn.Module:
        return GlobalBatchNorm.convert(model)

    def revert(self, model: nn.Module) -> nn.Module:
        return GlobalBatchNorm.revert(model)


# --- the factor: its exposure check, what its fix adds, and what DDPAudit watches ----------------

def _check(trainer, module, datamodule) -> Optional[str]:
    bns = [m for m in module.modules() if isinstance(m, _BatchNorm) and not isinstance(m, (nn.SyncBatchNorm, GlobalBatchNorm))]
    if world(trainer) > 1 and bns and getattr(trainer.strategy, "_layer_sync", None) is None:
        return (f"{len(bns)} BatchNorm layers normalise over the per-device batch: Trainer(sync_batchnorm=True) "
                f"on GPUs, plugins=[GlobalSyncBatchNorm()] on CPU")
    return None


def _fix(ddp: bool, accelerator: str) -> FixParts:
    if not ddp:
        return FixParts()
    if accelerator == "gpu":
        return FixParts(trainer={"sync_batchnorm": True})  # torch.nn.SyncBatchNorm (GPU only)
    return FixParts(plugins=[GlobalSyncBatchNorm()])


def _parts(spec, seed: int) -> FixParts:
    return _fix(spec.config == "ddp", spec.accelerator)


def _audit_parts(run) -> FixParts:
    return _fix(run.devices > 1, run.accelerator)


def _watch_layers(seen: Seen) -> list:
    """``train_start``: BatchNorm layers in training mode that normalise with per-rank statistics."""
    local = [n for n, m in seen.module.named_modules()
             if isinstance(m, _BatchNorm) and type(m).__name__ not in ("SyncBatchNorm", "GlobalBatchNorm") and m.training]
    if not local:
        return []
    shown = ", ".join(local[:3]) + (f" and {len(local) - 3} more" if len(local) > 3 else "")
    return [Finding("batchnorm", f"{len(local)} BatchNorm layer(s) normalise with per-rank statistics ({shown})",
                    "Trainer(sync_batchnorm=True) on GPUs; on CPU/gloo "
                    "Trainer(plugins=[vae_ddp.fixes.GlobalSyncBatchNorm()])")]


FACTOR = Factor(
    key="batchnorm", name="BatchNorm statistics", page="factors/batchnorm.md",
    changes="Trainer(sync_batchnorm=True) on GPUs; plugin GlobalSyncBatchNorm (a LayerSync) on CPU",
    check=_check, field="sync_bn", default=False, fixed=True, choices=(True,), parts=_parts,
    audit_parts=_audit_parts, off_label="BatchNorm back to per-rank", watch={"train_start": _watch_layers},
    clean="no per-rank BatchNorm layer")
