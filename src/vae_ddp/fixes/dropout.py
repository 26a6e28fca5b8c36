"""Dropout whose masks are drawn for the global batch: a drop-in for ``nn.Dropout``.

``nn.Dropout`` draws its mask from each process's default generator; under DDP after
``seed_everything`` every rank draws the same masks for its ``b`` rows, so DDP on ``N``
devices neither matches one device nor has independent masks across ranks.
[`GlobalBatchDropout`][vae_ddp.fixes.dropout.GlobalBatchDropout] draws the mask of the
global batch from the running [`GlobalBatchStream`][vae_ddp.fixes.randomness.GlobalBatchStream]
and keeps this rank's rows. Use it in a model directly, or let
[`GlobalBatchRandomness`][vae_ddp.fixes.randomness.GlobalBatchRandomness] swap a model's dropout
layers during ``fit`` (and put them back afterwards).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vae_ddp.fixes import _current

__all__ = ["GlobalBatchDropout", "GlobalBatchDropPath", "SWAPPABLE", "drop_path_layers"]

#: the dropout classes that [`GlobalBatchDropout.swap`][vae_ddp.fixes.dropout.GlobalBatchDropout.swap] replaces
SWAPPABLE = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)

_FUNCTIONAL = {nn.Dropout: F.dropout, nn.Dropout1d: F.dropout1d, nn.Dropout2d: F.dropout2d,
               nn.Dropout3d: F.dropout3d}
_CHANNEL_DIMS = {nn.Dropout1d: 1, nn.Dropout2d: 2, nn.Dropout3d: 3}


class GlobalBatchDropout(nn.Dropout):
    """``nn.Dropout`` (or ``Dropout1d/2d/3d`` with ``kind``) with global-batch masks.

    In training mode inside a training step served by a
    [`GlobalBatchStream`][vae_ddp.fixes.randomness.GlobalBatchStream], the keep mask is
    ``rand >= p`` with ``rand`` drawn (``torch.rand``, the input's dtype) at the global-batch
    shape and sliced to this rank's rows; kept elements are scaled by ``1 / (1 - p)`` as in
    ``nn.Dropout``. ``kind=nn.Dropout2d`` (and 1d/3d) drops whole channels: the mask has shape
    ``(b, C, 1, ...)`` for a batched input ``(b, C, *spatial)``. Outside such a step (no
    fix installed, a plain forward call) it is exactly the class it replaces; in eval mode
    it is the identity. Its distribution equals ``nn.Dropout``'s; its random numbers do not
    (another generator), so a model with it is not bit-equal to one with ``nn.Dropout``.

    Args:
        p: probability of an element (channel) to be zeroed, in ``[0, 1]``.
        inplace: as ``nn.Dropout`` (only used on the fallback path).
        batch_dim: the batch dimension of the input (1 for sequence-first ``(T, b, E)``).
        kind: the dropout class whose semantics it has: ``nn.Dropout`` (elementwise) or
            ``nn.Dropout1d/2d/3d`` (channel-wise).

    Input: any shape with the batch on ``batch_dim``; ``Dropout1d/2d/3d``: ``(b, C, *spatial)``
    with 1/2/3 spatial dimensions. Output: same shape and dtype.

    Raises:
        ValueError: ``p`` outside ``[0, 1]`` (from ``nn.Dropout``), or a ``kind`` that is not
            one of ``nn.Dropout``, ``nn.Dropout1d``, ``nn.Dropout2d``, ``nn.Dropout3d``.
    """

    def __init__(self, p: float = 0.5, inplace: bool = False, batch_dim: int = 0, kind: type = nn.Dropout) -> None:
        super().__init__(p, inplace)
        if kind not in _FUNCTIONAL:
            raise ValueError(f"kind must be one of {', '.join(c.__name__ for c in _FUNCTIONAL)}, got {kind!r}")
        self.batch_dim, self.kind = batch_dim, kind

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}, batch_dim={self.batch_dim}, kind={self.kind.__name__}"

    def forward(self, x: Tensor) -> Tensor:
        stream = _current.stream  # the running step's GlobalBatchStream (vae_ddp.fixes.randomness)
        if not self.training or stream is None:
            return _FUNCTIONAL[self.kind](x, self.p, self.training, self.inplace)
        if self.p == 0.0:
            return x
        if self.p == 1.0:
            return x * 0.0
        shape = list(x.shape)
        if self.kind is not nn.Dropout:
            spatial = _CHANNEL_DIMS[self.kind]
            if x.dim() != spatial + 2 or self.batch_dim != 0:
                raise ValueError(f"GlobalBatchDropout(kind={self.kind.__name__}) expects a batched input "
                                 f"(b, C, {spatial} spatial dims) with batch_dim=0, got shape {tuple(x.shape)}")
            shape = shape[:2] + [1] * spatial
        keep = stream.draw(torch.rand, shape, dtype=x.dtype, device=x.device, batch_dim=self.batch_dim) >= self.p
        return x * keep.to(x.dtype) / (1.0 - self.p)

    @classmethod
    def swap(cls, module: nn.Module, batch_dim: int = 0) -> list[tuple[nn.Module, str, nn.Module]]:
        """Replace, in place, every ``nn.Dropout``/``Dropout1d/2d/3d`` child of ``module`` (at
        any depth; not ``module`` itself) by a [`GlobalBatchDropout`][vae_ddp.fixes.dropout.GlobalBatchDropout]
        with the same ``p``, ``inplace`` and training mode. Returns ``[(parent, name, original),
        ...]`` for [`unswap`][vae_ddp.fixes.dropout.GlobalBatchDropout.unswap]."""
        swapped = []
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, SWAPPABLE) and not isinstance(child, GlobalBatchDropout):
                    new = cls(child.p, child.inplace, batch_dim=batch_dim,
                              kind=type(child) if type(child) in _FUNCTIONAL else nn.Dropout)
                    new.train(child.training)
                    setattr(parent, name, new)
                    swapped.append((parent, name, child))
        return swapped

    @staticmethod
    def unswap(swapped: list[tuple[nn.Module, str, nn.Module]]) -> None:
        """Put back the layers [`swap`][vae_ddp.fixes.dropout.GlobalBatchDropout.swap] replaced (with the
        training mode the replacement had at the end)."""
        for parent, name, original in reversed(swapped):
            current = getattr(parent, name)
            original.train(current.training)
            setattr(parent, name, original)


def drop_path_layers(module: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """The per-sample drop-path (stochastic depth) children of ``module`` at any depth:
    timm's ``DropPath`` (``timm.layers``, when timm is imported) and torchvision's
    ``StochasticDepth(mode="row")``, with a drop probability above 0. Returns ``[(parent, name,
    layer), ...]``. (``StochasticDepth(mode="batch")`` drops the whole batch with one draw: not
    a per-sample draw, so not one of them.)"""
    import sys

    from torchvision.ops import StochasticDepth

    timm_drop = sys.modules.get("timm.layers.drop")
    classes = (StochasticDepth,) + ((timm_drop.DropPath,) if timm_drop is not None else ())
    found = []
    for parent in list(module.modules()):
        if isinstance(parent, GlobalBatchDropPath):  # its original: served
            continue
        for name, child in list(parent.named_children()):
            if isinstance(child, classes):
                p = child.p if isinstance(child, StochasticDepth) else child.drop_prob
                if p > 0 and getattr(child, "mode", "row") == "row":
                    found.append((parent, name, child))
    return found


class GlobalBatchDropPath(nn.Module):
    """A drop-path layer (stochastic depth: each sample skips the residual branch with
    probability ``p``; Huang et al. 2016) whose per-sample keep draws are made for the global batch.

    It wraps the layer it replaces (timm's ``DropPath``, torchvision's ``StochasticDepth(mode="row")``):
    in training mode inside a training step served by a
    [`GlobalBatchStream`][vae_ddp.fixes.randomness.GlobalBatchStream], sample ``i`` is kept when
    ``rand >= p``, ``rand: (b, 1, ..., 1)`` drawn (``torch.rand``, the input's dtype) for the global
    batch and sliced to this rank's rows, and kept samples are scaled by ``1 / (1 - p)`` (timm's
    ``scale_by_keep=False``: not scaled), as the original does. Outside such a step it calls the
    original layer; in eval mode both are the identity.

    Args:
        original: the drop-path layer it replaces.

    Input: ``(b, ...)``, the batch first. Output: same shape and dtype.
    """

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.original = original
        self.p = float(getattr(original, "drop_prob", getattr(original, "p", 0.0)))
        self.scale = bool(getattr(original, "scale_by_keep", True))

    def forward(self, x: Tensor) -> Tensor:
        stream = _current.stream
        if not self.training or stream is None or self.p == 0.0:
            self.original.train(self.training)
            return self.original(x)
        keep = stream.draw(torch.rand, [x.shape[0]] + [1] * (x.dim() - 1), dtype=x.dtype, device=x.device) >= self.p
        mask = keep.to(x.dtype)
        return x * (mask / (1.0 - self.p) if self.scale and self.p < 1.0 else mask)

    @classmethod
    def swap(cls, module: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
        """Replace, in place, every layer of [`drop_path_layers`][vae_ddp.fixes.dropout.drop_path_layers]
        by a [`GlobalBatchDropPath`][vae_ddp.fixes.dropout.GlobalBatchDropPath] around it (same training
        mode). Returns ``[(parent, name, original), ...]`` for
        [`GlobalBatchDropout.unswap`][vae_ddp.fixes.dropout.GlobalBatchDropout.unswap]."""
        swapped = []
        for parent, name, child in drop_path_layers(module):
            new = cls(child)
            new.train(child.training)
            setattr(parent, name, new)
            swapped.append((parent, name, child))
        return swapped
