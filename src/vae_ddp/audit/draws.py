"""Random draws the audit cannot key to a sample: dropout inside ``scaled_dot_product_attention``.

``torch.nn.functional.scaled_dot_product_attention(..., dropout_p=p)`` (what Hugging Face's
SDPA attention, timm's and PyTorch's ``nn.MultiheadAttention`` call) draws its dropout mask
inside the kernel from torch's generator, for the whole ``(B, heads, L, S)`` attention matrix:
no callback can give one device's rows to each rank, so DDP's step is not one device's whatever
the fixes, and the one-device floor (the samples permuted) is not rounding either. The audit
then judges in two parts: the rest of the step with that dropout off in every compared run
([`NoAttentionDropout`][vae_ddp.audit.draws.NoAttentionDropout]), and the draws themselves,
which must at least differ across ranks (Lightning's ``seed_everything`` gives every rank the
same generator: each draws the same masks).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from pytorch_lightning import Callback, LightningModule, Trainer
from torch import nn

__all__ = ["attention_dropout_layers", "NoAttentionDropout"]


@contextlib.contextmanager
def _sdpa(replacement) -> Iterator[None]:
    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = replacement(original)
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def attention_dropout_layers(module: nn.Module, step: Any) -> list[str]:
    """The layers of ``module`` that call ``scaled_dot_product_attention`` with ``dropout_p > 0``
    while ``step()`` runs (a training step), as ``["name (Class, dropout_p=p)", ...]``, found by
    forward hooks that track the innermost module running (the call goes through
    ``torch.nn.functional``'s attribute, as PyTorch's and Hugging Face's code make it)."""
    names = {id(m): n for n, m in module.named_modules()}
    running: list[nn.Module] = []
    found: dict[str, None] = {}

    def recording(original):
        def sdpa(*args, **kwargs):
            p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            if p and running:
                m = running[-1]
                found[f"{names.get(id(m), '') or 'the LightningModule'} ({type(m).__name__}, dropout_p={p:g})"] = None
            return original(*args, **kwargs)
        return sdpa

    def enter(m: nn.Module, args: Any) -> None:
        running.append(m)

    def leave(m: nn.Module, args: Any, out: Any) -> None:
        running.pop()

    hooks = [m.register_forward_pre_hook(enter) for m in module.modules()]
    hooks += [m.register_forward_hook(leave) for m in module.modules()]
    try:
        with _sdpa(recording):
            step()
    finally:
        for h in hooks:
            h.remove()
    return list(found)


class NoAttentionDropout(Callback):
    """For the audit's compared runs only: ``scaled_dot_product_attention`` with ``dropout_p=0``
    and every ``nn.MultiheadAttention``'s ``dropout`` 0 during ``fit`` (restored after), so that the
    rest of the step can be judged against one device's."""

    def __init__(self) -> None:
        self._patch: Any = None
        self._saved: list[tuple[nn.Module, float]] = []

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        def off(original):
            def sdpa(*args, **kwargs):
                if len(args) > 4:
                    args = (*args[:4], 0.0, *args[5:])
                else:
                    kwargs["dropout_p"] = 0.0
                return original(*args, **kwargs)
            return sdpa

        self._patch = _sdpa(off)
        self._patch.__enter__()
        self._saved = [(m, m.dropout) for m in pl_module.modules() if isinstance(m, nn.MultiheadAttention)]
        for m, _ in self._saved:
            m.dropout = 0.0

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._patch is not None:
            self._patch.__exit__(None, None, None)
            self._patch = None
        for m, p in self._saved:
            m.dropout = p
        self._saved = []
