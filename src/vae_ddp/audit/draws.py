"""Random draws the audit cannot key to a sample: dropout inside ``scaled_dot_product_attention``,
and torch's random functions (``torch.randn_like``, ``torch.rand``, ...) called in the training step.

``torch.nn.functional.scaled_dot_product_attention(..., dropout_p=p)`` (what Hugging Face's
SDPA attention, timm's and PyTorch's ``nn.MultiheadAttention`` call) draws its dropout mask
inside the kernel from torch's generator, for the whole ``(B, heads, L, S)`` attention matrix:
no callback can give one device's rows to each rank, so DDP's step is not one device's whatever
the fixes, and the one-device floor (the samples permuted) is not rounding either. The audit
then judges in two parts: the rest of the step with that dropout off in every compared run
([`NoAttentionDropout`][vae_ddp.audit.draws.NoAttentionDropout]), and the draws themselves,
which must at least differ across ranks (Lightning's ``seed_everything`` gives every rank the
same generator: each draws the same masks).

``torch.rand(...)``, ``torch.randn_like(x)`` and the other random functions of torch called in
``forward`` or ``training_step`` draw from torch's generator in call order, not per sample: one
device's sample i and the rank that holds it draw other numbers, so neither the comparison with
one device nor the permuted floor measures rounding. For the compared runs only,
[`KeyedTorchDraws`][vae_ddp.audit.draws.KeyedTorchDraws] keys those draws to the samples (a draw
whose first dimension is the per-device batch size takes this rank's rows of a draw for the whole
global batch; any other draw is the same on every rank), and the draws themselves are judged
apart, as attention dropout's: they must at least differ across ranks.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from pytorch_lightning import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from vae_ddp.fixes.factor import batch_tensors
from vae_ddp.fixes.randomness import GlobalBatchStream

__all__ = ["unkeyed_draws", "draws_verdict", "KeyedTorchDraws", "NoAttentionDropout", "TORCH_DRAWS"]


@contextlib.contextmanager
def _sdpa(replacement) -> Iterator[None]:
    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = replacement(original)
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


#: torch's random functions the audit keys to samples (``generator=`` given: the caller's own stream, left alone)
TORCH_DRAWS: dict[Any, str] = {
    torch.rand: "torch.rand", torch.randn: "torch.randn", torch.rand_like: "torch.rand_like",
    torch.randn_like: "torch.randn_like", torch.randint: "torch.randint", torch.randint_like: "torch.randint_like",
    torch.bernoulli: "torch.bernoulli", torch.normal: "torch.normal", Tensor.uniform_: "Tensor.uniform_",
    Tensor.normal_: "Tensor.normal_", Tensor.bernoulli_: "Tensor.bernoulli_",
}


def _served_layers(module: nn.Module) -> set[int]:
    """``id``s of the layers whose draws the fixes serve already (``nn.Dropout`` and its 1d/2d/3d
    forms, drop-path: [`GlobalBatchRandomness`][vae_ddp.fixes.randomness.GlobalBatchRandomness]
    swaps them): the torch calls inside them are not the user's own draws."""
    from vae_ddp.fixes.dropout import SWAPPABLE, drop_path_layers

    served = {id(layer) for _, _, layer in drop_path_layers(module)}
    return served | {id(m) for m in module.modules() if isinstance(m, SWAPPABLE)}


class _Inside:
    """Counts how deep the running forward is inside the layers of ``ids`` (forward hooks on them)."""

    def __init__(self, module: nn.Module, ids: set[int]) -> None:
        self.depth = 0
        layers = [m for m in module.modules() if id(m) in ids]
        self.hooks = [m.register_forward_pre_hook(self._enter) for m in layers]
        self.hooks += [m.register_forward_hook(self._leave) for m in layers]

    def _enter(self, m: nn.Module, args: Any) -> None:
        self.depth += 1

    def _leave(self, m: nn.Module, args: Any, out: Any) -> None:
        self.depth -= 1

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


class _Recording(TorchFunctionMode):
    """Records which of ``TORCH_DRAWS`` run without a ``generator=``, in which module (none inside a
    layer the fixes serve)."""

    def __init__(self, where, inside: _Inside) -> None:
        super().__init__()
        self.where, self.inside, self.found = where, inside, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = TORCH_DRAWS.get(func)
        if name is not None and kwargs.get("generator") is None and not self.inside.depth:
            self.found[f"{name} in {self.where()}"] = None
        return func(*args, **kwargs)


def unkeyed_draws(module: nn.Module, step: Any) -> tuple[list[str], list[str]]:
    """The random draws of ``module`` that no fix keys to a sample while ``step()`` runs (a
    training step): ``(attention, torch_draws)``, the layers that call
    ``scaled_dot_product_attention`` with ``dropout_p > 0`` as ``["name (Class, dropout_p=p)", ...]``
    and the calls of torch's random functions without a ``generator=`` as
    ``["torch.randn_like in name (Class)", ...]`` ("the LightningModule" for a call outside any
    submodule's ``forward``; none inside the dropout and drop-path layers the fixes serve). Found by
    forward hooks that track the innermost module running (the
    attention call goes through ``torch.nn.functional``'s attribute, as PyTorch's and Hugging
    Face's code make it) and a ``TorchFunctionMode`` that sees torch's functions."""
    names = {id(m): n for n, m in module.named_modules()}
    running: list[nn.Module] = []
    found: dict[str, None] = {}

    def where(p: Optional[float] = None) -> str:
        m = running[-1] if running else module
        inner = "" if p is None else f", dropout_p={p:g}"
        return f"{names.get(id(m), '') or 'the LightningModule'} ({type(m).__name__}{inner})"

    def recording(original):
        def sdpa(*args, **kwargs):
            p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            if p and running:
                found[where(p)] = None
            return original(*args, **kwargs)
        return sdpa

    def enter(m: nn.Module, args: Any) -> None:
        running.append(m)

    def leave(m: nn.Module, args: Any, out: Any) -> None:
        running.pop()

    hooks = [m.register_forward_pre_hook(enter) for m in module.modules()]
    hooks += [m.register_forward_hook(leave) for m in module.modules()]
    inside = _Inside(module, _served_layers(module))
    mode = _Recording(where, inside)
    try:
        with _sdpa(recording), mode:
            step()
    finally:
        inside.remove()
        for h in hooks:
            h.remove()
    return list(found), list(mode.found)


def _size(args: tuple) -> list[int]:
    return list(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else list(args)


class _Keyed(TorchFunctionMode):
    """Serves ``TORCH_DRAWS`` called without ``generator=`` from a
    [`GlobalBatchStream`][vae_ddp.fixes.randomness.GlobalBatchStream]: a draw whose dimension 0 is
    the per-device batch size ``b`` is this rank's rows of the global batch's draw (permuted with the
    samples under [`WithinBatchPermutation`][vae_ddp.harness.permutation.WithinBatchPermutation]),
    any other draw the same on every rank."""

    def __init__(self, stream: GlobalBatchStream, b: int, permutation: Any, inside: Optional[_Inside] = None) -> None:
        super().__init__()
        self.stream, self.b, self.permutation, self.inside = stream, b, permutation, inside

    def _draw(self, fn, size, dtype, device) -> Tensor:
        size, device = list(size), torch.device(device if device is not None else "cpu")
        if size and size[0] == self.b:
            out = self.stream.draw(fn, size, dtype=dtype, device=device)
            return out if self.permutation is None else self.permutation.follow(out)
        return fn(size, generator=self.stream.generator(device), dtype=dtype, device=device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func not in TORCH_DRAWS or kwargs.get("generator") is not None or (self.inside and self.inside.depth):
            return func(*args, **kwargs)
        keyed = self._keyed(func, args, kwargs)
        return func(*args, **kwargs) if keyed is None else keyed

    def _keyed(self, func, args: tuple, kw: dict) -> Optional[Tensor]:
        if func in (torch.rand, torch.randn) and not kw.get("out"):
            out = self._draw(func, _size(args), kw.get("dtype"), kw.get("device"))
            return out.requires_grad_(bool(kw.get("requires_grad")))
        if func in (torch.rand_like, torch.randn_like):
            x = args[0]
            fn = torch.rand if func is torch.rand_like else torch.randn
            return self._draw(fn, x.shape, kw.get("dtype") or x.dtype, kw.get("device") or x.device)
        if func is torch.bernoulli and len(args) == 1 and not kw:
            p = args[0]
            return (self._draw(torch.rand, p.shape, p.dtype, p.device) < p).to(p.dtype)
        if func is torch.normal and len(args) == 2 and isinstance(args[0], Tensor) and not kw:
            mean, std = args
            shape = torch.broadcast_shapes(mean.shape, std.shape if isinstance(std, Tensor) else ())
            return mean + std * self._draw(torch.randn, shape, mean.dtype, mean.device)
        if func is Tensor.uniform_:
            t, (lo, hi) = args[0], (list(args[1:]) + [kw.get("from", 0.0), kw.get("to", 1.0)][len(args) - 1:])[:2]
            with torch.no_grad():
                return t.copy_(lo + (hi - lo) * self._draw(torch.rand, t.shape, t.dtype, t.device))
        if func is Tensor.normal_:
            t, (mu, sd) = args[0], (list(args[1:]) + [kw.get("mean", 0.0), kw.get("std", 1.0)][len(args) - 1:])[:2]
            with torch.no_grad():
                return t.copy_(mu + sd * self._draw(torch.randn, t.shape, t.dtype, t.device))
        if func is Tensor.bernoulli_ and len(args) <= 2 and not kw:
            t, p = args[0], (args[1] if len(args) > 1 else 0.5)
            with torch.no_grad():
                return t.copy_(self._draw(torch.rand, t.shape, t.dtype, t.device) < p)
        return None  # randint and the other spellings: drawn as the user's code draws them


class KeyedTorchDraws(Callback):
    """For the audit's compared runs only: torch's random functions called during each training
    batch (without ``generator=``: ``torch.rand``, ``torch.randn``, their ``_like`` forms,
    ``torch.bernoulli(p)``, ``torch.normal(mean, std)``, ``Tensor.uniform_``/``normal_``/
    ``bernoulli_``) draw from a [`GlobalBatchStream`][vae_ddp.fixes.randomness.GlobalBatchStream]
    seeded with ``seed`` and the batch's index, so that sample i meets the same numbers on one device
    and under DDP whatever the world size: a draw whose dimension 0 is the per-device batch size
    takes this rank's rows of the global batch's draw, any other draw is the same on every rank
    (as one device draws it once for the global batch). A permuted floor run
    ([`WithinBatchPermutation`][vae_ddp.harness.permutation.WithinBatchPermutation]) permutes the
    rows with their samples. ``torch.randint`` and other spellings are left as drawn, and so are the
    draws inside the dropout and drop-path layers the fixes serve (a run without those fixes keeps
    them as Lightning's defaults draw them).

    Args:
        seed: the stream's base seed (the same in every compared run and rank).
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._batch = 0
        self._mode: Optional[_Keyed] = None
        self._permutation: Any = None
        self._inside: Optional[_Inside] = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from vae_ddp.harness.permutation import WithinBatchPermutation

        self._batch = 0
        self._permutation = next((c for c in trainer.callbacks if isinstance(c, WithinBatchPermutation)), None)
        self._inside = _Inside(pl_module, _served_layers(pl_module))

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._inside is not None:
            self._inside.remove()
            self._inside = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        stream = GlobalBatchStream(self.seed, trainer.global_rank, trainer.world_size)
        stream.step = self._batch  # its own generators, never the fixes' current stream
        self._mode = _Keyed(stream, len(batch_tensors(batch)[0]), self._permutation, self._inside)
        self._mode.__enter__()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._leave()
        self._batch += 1

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._leave()

    def _leave(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None


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


def draws_verdict(attention: list[str], torch_draws: list[str], default_findings: list[dict],
                  items: Optional[dict] = None) -> dict:
    """The second part of the verdict of a module whose draws no fix keys to a sample (dropout inside
    ``scaled_dot_product_attention``; torch's random functions in the step; a dataset's augmentation
    in ``__getitem__``, ``items``: [`loader_draws.verdict`][vae_ddp.audit.loader_draws.verdict] of
    what the ranks' loaders drew): are they the same on every rank under Lightning's defaults (the
    ``ddp`` run's noise check: the ranks' generators alike, and the step draws; the ranks' loaders
    reading the same samples; not measured counts as the same)? ``{"attention", "torch", "dataset"
    (with ``items`` only), "repeated", "finding"}``, the finding being the noise factor's row (``default_findings``: the
    ``ddp`` run's ``DDPAudit`` findings, as dicts), every cause in it: the dataset's draws beside the step's own
    that ``DDPAudit`` saw repeated (dropout masks)."""
    from vae_ddp.fixes import noise

    step = bool(attention or torch_draws)
    step_repeated = step and any(f["factor"] == noise.FACTOR.key and not f.get("manual") for f in default_findings)
    repeated = step_repeated or bool(items and items["repeated"] is not False)
    state = ("every rank draws the same numbers (Lightning's seed_everything gives the ranks one generator)"
             if step_repeated else "the ranks draw different numbers")
    what, fix = [], []
    if attention:
        what.append(f"dropout inside scaled_dot_product_attention in {', '.join(attention)} draws its masks for the "
                    "whole attention matrix from torch's generator, which no fix can deal to the ranks as one "
                    "device's rows: the rest of the step is compared with it off")
        fix.append("apply the attention dropout as an nn.Dropout on the attention weights, which the fix serves")
    if torch_draws:
        verb = "draws" if len(torch_draws) == 1 else "draw"
        what.append(f"{', '.join(torch_draws)} {verb} from torch's generator in call order, not per sample: the rest "
                    "of the step is compared with those draws keyed to the samples")
        fix.append("draw them per sample with vae_ddp.fixes.global_batch_draw (e.g. global_batch_draw(torch.randn, "
                   "x.shape, x.dtype, x.device) for torch.randn_like(x)) under vae_ddp.fixes.GlobalBatchRandomness")
    evidence = "; ".join(what) + (f"; under Lightning's defaults {state}" if step else "")
    fixes = ("seed each rank's generator differently (vae_ddp.fixes.PerRankSeed, or seed_everything(seed + "
             "self.global_rank) in setup): the ranks' draws are then independent, as one device's rows are; or "
             + "; or ".join(fix)) if step else ""
    if items:
        evidence += ("; " if step else "") + ("the dataset draws random augmentation in __getitem__ (the rest of the "
                                               "step is compared with each sample's draws keyed to its index): "
                                               + items["state"])
        fixes += ("; for the dataset's draws: " if step else "") + items["fix"]
    own = [f for f in default_findings if f["factor"] == noise.FACTOR.key and not f.get("manual")]
    if items and not step and own:  # the step's own draws repeated too (dropout masks): every cause at once
        evidence, fixes = own[0]["evidence"] + "; " + evidence, own[0]["fix"] + "; for the dataset's draws: " + fixes
    finding = {"factor": noise.FACTOR.key, "manual": True, "unkeyed": True, "evidence": evidence, "fix": fixes}
    return {"attention": attention, "torch": torch_draws, **({"dataset": items} if items else {}), "repeated": repeated,
            "finding": finding}
