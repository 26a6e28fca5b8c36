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
Nothing in it is specific to gloo or to CPUs: it uses two ``all_reduce`` calls per layer
forward and one per layer backward, which every backend has. Its training forward rounds as
``nn.BatchNorm``'s CPU kernel does on the concatenated batch, so its output is bitwise that of
one device (float32 included).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from pytorch_lightning import Callback
from pytorch_lightning.plugins import LayerSync
from pytorch_lightning.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from vae_ddp.fixes.factor import Audit, Factor, Finding, FixParts, Seen, Switch, loader_list, world

__all__ = ["GlobalBatchNorm", "GlobalSyncBatchNorm", "FACTOR", "batch_stats", "normalize", "sync_batchnorm_parts"]


def _world_size(group) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _stat_dtype(x: Tensor) -> torch.dtype:
    """The statistics' dtype: ``x``'s, or float32 for a bfloat16/float16 input (autocast), as torch's
    CPU kernel keeps the statistics of a reduced-precision input in float32 beside float32 parameters."""
    return torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype


def _reduce_dims(x: Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


def _sums(x: Tensor) -> Tensor:
    """``[count, sum_c x]``: the local count and per-channel sums of ``x`` ``(B, C, ...)``,
    float64 ``(1 + C,)``; summed over ranks they give the global mean."""
    c = x.shape[1]
    return torch.cat([torch.full((1,), float(x.numel() // c), dtype=torch.float64, device=x.device),
                      torch.sum(x, _reduce_dims(x), dtype=torch.float64)])


def _mean(sums: Tensor, dtype: torch.dtype) -> tuple[Tensor, float]:
    """The mean per channel in ``dtype`` ``(C,)`` and the count, from the global ``sums``: the
    float64 sum divided by the count, rounded once to ``dtype`` (as torch's CPU kernel does)."""
    total = float(sums[0])
    if total == 0:
        raise ValueError("GlobalBatchNorm: the global batch is empty on every rank")
    return (sums[1:] / total).to(dtype), total


def _centred_sums(x: Tensor, mean: Tensor) -> Tensor:
    """``sum_c (x - mean)**2``, float64 ``(C,)``: the difference and the square in ``x.dtype``,
    the sum in float64 (as torch's CPU kernel does); summed over ranks, the global ``var_sum``."""
    d = x - mean.view([1, -1] + [1] * (x.dim() - 2))
    return torch.sum(d * d, _reduce_dims(x), dtype=torch.float64)


def _var_invstd(var_sum: Tensor, total: float, eps: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``var_sum`` and ``1 / sqrt(var + eps)`` in ``dtype`` ``(C,)`` from the global float64
    ``var_sum``: ``var_sum`` rounded to ``dtype``, ``var = var_sum / count`` in ``dtype``, the inverse
    square root in float64 and rounded once, as ``torch.native_batch_norm`` computes
    ``save_invstd`` on CPU (``InvStd<double>``)."""
    var_sum = var_sum.to(dtype)
    var = (var_sum / total).to(torch.float64)
    invstd = 1.0 / torch.sqrt(var + eps)
    if eps == 0:
        invstd = torch.where(var == 0, torch.zeros_like(invstd), invstd)
    return var_sum, invstd.to(dtype)


def batch_stats(parts: list[Tensor], eps: float = 1e-5) -> tuple[Tensor, Tensor, Tensor, float]:
    """What the ranks holding ``parts`` (``(B_r, C, ...)`` each, one dtype) compute together, in one
    process: the mean, ``var_sum = sum (x - mean)**2`` and ``invstd = 1 / sqrt(var_sum / count + eps)``
    per channel (each ``(C,)``, the parts' dtype) and the global count of the concatenated batch.
    The same steps as ``GlobalBatchNorm`` in training (the sums that it all-reduces are summed
    here), for tests and for checking a split without a process group.

    Raises:
        ValueError: every part is empty.
    """
    mean, total = _mean(sum(_sums(p) for p in parts), _stat_dtype(parts[0]))
    var_sum, invstd = _var_invstd(sum(_centred_sums(p, mean) for p in parts), total, eps, _stat_dtype(parts[0]))
    return mean, var_sum, invstd, total


@torch.no_grad()
def _global_stats(x: Tensor, group, eps: float) -> tuple[Tensor, Tensor, Tensor, float]:
    """Mean, ``var_sum = sum (x - mean)**2`` and ``invstd`` per channel over every rank's ``x``
    (``x.dtype``, ``(C,)``), and the global count.

    Two ``all_reduce`` calls of float64 sums: ``[count, sum x]`` (``C + 1`` numbers), then, around
    the global mean, ``sum (x - mean)**2`` (``C`` numbers). Each step rounds as torch's CPU
    BatchNorm does on the concatenated batch (sums in float64, the mean and ``var_sum`` rounded
    once to ``x.dtype``, ``invstd`` from float64), so the statistics are bitwise those of
    ``nn.BatchNorm`` on one device (up to the order of float64 additions) rather than a last-bit
    neighbour of them: in float32 a last-bit difference in a BatchNorm output can flip the sign
    of a ReLU input within rounding of zero and change the step's gradient by 1e-3 relative (issue
    37). Centring on the global mean before squaring does not cancel when ``|mean| >> std``, as
    sums of ``x`` and ``x**2`` would.
    """
    sums = _sums(x)
    dist.all_reduce(sums, group=group)
    mean, total = _mean(sums, _stat_dtype(x))
    var_sum = _centred_sums(x, mean)
    dist.all_reduce(var_sum, group=group)
    var_sum, invstd = _var_invstd(var_sum, total, eps, _stat_dtype(x))
    return mean, var_sum, invstd, total


def normalize(x: Tensor, mean: Tensor, invstd: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]) -> Tensor:
    """``(x - mean) * invstd * weight + bias`` per channel, rounded as torch's own BatchNorm kernel
    rounds it in training mode: through that kernel (``F.batch_norm`` in eval mode with variance 1
    and ``eps`` 0, so its ``invstd`` is exactly 1, and the weight ``invstd * weight``), which forms
    ``alpha = invstd * weight``, ``beta = bias - mean * alpha`` and ``x * alpha + beta`` as it does with
    statistics of its own (a formula written here would differ in the last bit where the
    compiled kernel fuses a multiply-add). ``x``: ``(B, C, ...)``; the others ``(C,)``, ``x.dtype``."""
    alpha = invstd * weight if weight is not None else invstd
    return torch.nn.functional.batch_norm(x, mean, torch.ones_like(invstd), alpha, bias, False, 0.0, 0.0)


class _GlobalBatchNormFn(torch.autograd.Function):
    """Batch normalisation with given global statistics; backward all-reduces the two
    per-channel sums the input gradient needs (``sum dy`` and ``sum dy * x_hat``) in one call,
    as ``torch.nn.modules._functions.SyncBatchNorm.backward`` does."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, var, invstd, eps, total, group):
        ctx.save_for_backward(x, weight, mean, var, invstd)
        ctx.eps, ctx.total, ctx.group = eps, total, group
        return normalize(x, mean, invstd, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, var, invstd = ctx.saved_tensors
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
            k = w * invstd / ctx.total
            # dx = dy*w*invstd - k*(sum_dy + x_hat*sum_dy_xhat), x_hat = (x - mean)*invstd
            slope = k * invstd * g_dy_xhat
            offset = k * g_dy - slope * mean
            shape = [1, -1] + [1] * (x.dim() - 2)
            grad_x = grad_local.addcmul_(x, slope.view(shape), value=-1.0).sub_(offset.view(shape))
        grad_w = sum_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = sum_dy if ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


def _update_running(buffer: Tensor, value: Tensor, factor: float, fused: bool = False) -> None:
    """``buffer = factor * value + (1 - factor) * buffer`` in the buffer's dtype, rounded as torch's
    CPU kernel rounds its running statistics: ``factor`` and ``1 - factor`` in that dtype, the
    ``running_mean`` update unfused, the ``running_var`` update (``fused``) with one fused
    multiply-add (``addcmul``; measured bitwise against ``nn.BatchNorm2d``, torch 2.14 on AVX-512).
    ``value``: ``(C,)``, ``factor``: a float in (0, 1]."""
    f = torch.tensor(factor, dtype=buffer.dtype, device=buffer.device)
    value = value.to(buffer.dtype)
    if fused:
        buffer.copy_(torch.addcmul((1 - f) * buffer, value, f.expand_as(value)))
    else:
        buffer.copy_(f * value + (1 - f) * buffer)


def _memory_format(x: Tensor) -> torch.memory_format:
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


class GlobalBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are those of the global batch across all ranks.

    In training mode with a process group of world size > 1, the per-channel mean and
    biased variance are those of the samples of every rank (two ``all_reduce`` calls of float64
    sums: the sums of ``x``, then those of ``(x - mean)**2`` around the global mean; rounded and
    applied as torch's CPU kernel does, so for a contiguous input the output is bitwise
    ``nn.BatchNorm``'s on the concatenated batch; torch sums a channels-last input per thread in
    its own dtype, which this matches to rounding only), and the backward pass all-reduces
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
        mean, var_sum, invstd, total = _global_stats(x, self.process_group, self.eps)
        var = var_sum / total
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                _update_running(self.running_mean, mean, factor)
                _update_running(self.running_var, var_sum / (total - 1) if total > 1 else var, factor, fused=True)
        return _GlobalBatchNormFn.apply(x, self.weight, self.bias, mean, var, invstd, self.eps, total,
                                        self.process_group)

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

    ``apply`` also adds a callback to the module's ``Trainer`` (once) that warns, on rank 0, when a training or
    validation loader starts its workers with ``fork`` from the rank, which runs threads: such a worker can block
    at start and the training hang, the other rank waiting in `GlobalBatchNorm`'s first ``all_reduce``
    ([`vae_ddp.workers.fork_hazard`][vae_ddp.workers.fork_hazard]).
    """

    def apply(self, model: nn.Module) -> nn.Module:
        trainer = getattr(model, "_trainer", None)
        if trainer is not None and not any(isinstance(c, _ForkedWorkers) for c in trainer.callbacks):
            trainer.callbacks.append(_ForkedWorkers())
        return GlobalBatchNorm.convert(model)

    def revert(self, model: nn.Module) -> nn.Module:
        return GlobalBatchNorm.revert(model)


class _ForkedWorkers(Callback):
    """The warning of [`GlobalSyncBatchNorm`][vae_ddp.fixes.batchnorm.GlobalSyncBatchNorm]: once, on rank 0, at the
    start of training or validation, when a loader forks its workers from this rank while it runs threads."""

    def __init__(self) -> None:
        self.warned = False

    def on_train_start(self, trainer, pl_module) -> None:
        self._check(trainer.train_dataloader)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._check(trainer.val_dataloaders)

    def _check(self, loaders) -> None:
        from vae_ddp.workers import fork_hazard

        if self.warned:
            return
        for dl in loader_list(loaders):
            note = fork_hazard(dl)
            if note:
                rank_zero_warn(note)
                self.warned = True
                return


# --- the factor: its exposure check, what its fix adds, and what DDPAudit watches ----------------

def _check(trainer, module, datamodule) -> Optional[str]:
    bns = [m for m in module.modules()
           if isinstance(m, _BatchNorm) and not isinstance(m, (nn.SyncBatchNorm, GlobalBatchNorm))]
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


def sync_batchnorm_parts(accelerator: str) -> FixParts:
    """What ``Trainer(sync_batchnorm=True)`` becomes in a DDP run on ``accelerator`` ("cpu" or "gpu"): itself on
    GPUs; on CPU the plugin [`GlobalSyncBatchNorm`][vae_ddp.fixes.batchnorm.GlobalSyncBatchNorm], the same
    global-batch statistics (Lightning converts the layers to ``torch.nn.SyncBatchNorm``, whose kernels exist for
    CUDA only in torch 2.x, and DDP's constructor refuses it on CPU)."""
    return _fix(True, accelerator)


def _parts(spec, seed: int) -> FixParts:
    return _fix(spec.config == "ddp", spec.accelerator)


def _audit_parts(run) -> FixParts:
    return _fix(run.devices > 1, run.accelerator)


def _idle(trainer, module: nn.Module) -> bool:
    """The fix converts BatchNorm layers only: idle for a module without any."""
    return not any(isinstance(m, _BatchNorm) for m in module.modules())


def _watch_layers(seen: Seen) -> list:
    """``train_start``: BatchNorm layers in training mode that normalise with per-rank statistics."""
    local = [n for n, m in seen.module.named_modules()
             if isinstance(m, _BatchNorm) and type(m).__name__ not in ("SyncBatchNorm", "GlobalBatchNorm")
             and m.training]
    if not local:
        return []
    shown = ", ".join(local[:3]) + (f" and {len(local) - 3} more" if len(local) > 3 else "")
    return [Finding("batchnorm", f"{len(local)} BatchNorm layer(s) normalise with per-rank statistics ({shown})",
                    "Trainer(sync_batchnorm=True) on GPUs; on CPU/gloo "
                    "Trainer(plugins=[vae_ddp.fixes.GlobalSyncBatchNorm()])")]


FACTOR = Factor(
    position=2, key="batchnorm", name="BatchNorm statistics", page="factors/batchnorm.md",
    changes="Trainer(sync_batchnorm=True) on GPUs; plugin GlobalSyncBatchNorm (a LayerSync) on CPU",
    check=_check,
    switch=Switch("sync_bn", default=False, fixed=True, choices=(True,), parts=_parts,
                  off_label="BatchNorm back to per-rank"),
    audit=Audit(parts=_audit_parts, watch={"train_start": _watch_layers}, clean="no per-rank BatchNorm layer",
                idle=_idle))
