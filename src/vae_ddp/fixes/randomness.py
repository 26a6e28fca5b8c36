"""Global-batch randomness: any random draw of a training step, independent of the world size.

Under DDP every rank runs the same code from the same ``seed_everything`` seed, so every
draw made inside ``training_step`` (reparameterization noise, dropout masks, random
augmentation) repeats on every rank: the global batch carries ``B/N`` independent draws,
each used ``N`` times, and no world size draws what one device draws.

The mechanism here: at training batch ``k`` every rank seeds a private
``torch.Generator`` alike (``seed * 1_000_003 + k``; one per device type, the global
generator is not touched). A module that needs a random tensor of its local shape
``(b, ...)`` draws the *global-batch* shape ``(N * b, ...)`` from that generator and keeps
the rows of its rank, ``[rank * b, (rank + 1) * b)``. With a sampler that gives rank ``r``
the ``r``-th contiguous chunk of each global batch
([`GlobalBatchDistributedSampler`][vae_ddp.fixes.sampler.GlobalBatchDistributedSampler]),
sample ``i`` of step ``k`` then gets the same random numbers on any number of devices,
one device included. Successive draws of a step continue the same generator, so a model
that draws several times (noise, then several dropout layers) stays aligned as long as it
draws in the same order on every world size, which the same forward code does.

- [`GlobalBatchStream`][vae_ddp.fixes.randomness.GlobalBatchStream]: the per-step generator and
  [`draw`][vae_ddp.fixes.randomness.GlobalBatchStream.draw].
- [`global_batch_draw`][vae_ddp.fixes.randomness.global_batch_draw]: what a module calls; it uses
  the stream of the running training step, or draws as usual outside one.
- [`GlobalBatchRandomness`][vae_ddp.fixes.randomness.GlobalBatchRandomness]: the Lightning callback
  that opens the stream around every training batch, swaps ``nn.Dropout`` layers for
  [`GlobalBatchDropout`][vae_ddp.fixes.dropout.GlobalBatchDropout] during ``fit`` (and restores
  them), serves a module's ``noise`` attribute, sets the epoch of
  [`SeededAugmentation`][vae_ddp.fixes.augmentation.SeededAugmentation] datasets, and warns once
  (rank 0) when the module never drew from it or has random layers it cannot cover.

Costs and assumptions: each rank draws ``N`` times the numbers it keeps (memory and time of
the draw grow with the world size); every rank must have the same per-device batch size
``b`` at every step (true with the sampler above, which drops the incomplete last batch);
the batch dimension is dimension 0 unless a draw says otherwise (``batch_dim``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from pytorch_lightning import Callback, LightningModule, Trainer
from pytorch_lightning.utilities import rank_zero_warn
from torch import Tensor, nn

from vae_ddp.fixes import _current, _env
from vae_ddp.fixes.augmentation import set_augmentation_epoch
from vae_ddp.fixes.dropout import SWAPPABLE, GlobalBatchDropout, GlobalBatchDropPath, drop_path_layers

__all__ = ["GlobalBatchStream", "global_batch_draw", "current_stream", "GlobalBatchRandomness",
           "uncovered_random_layers"]

#: multiplier of the base seed in the per-step seed ``seed * STEP_SEED_MULTIPLIER + step``
STEP_SEED_MULTIPLIER = 1_000_003


class GlobalBatchStream:
    """The random numbers of one training step, shared by all ranks.

    Args:
        seed: base seed, the same on every rank; default: ``seed_everything``'s seed
            (``PL_GLOBAL_SEED``), else 0, read when the stream is built.
        rank: this process's global rank; default: from the process group, else 0.
        world_size: number of ranks ``N``; default: from the process group, else 1.

    Attributes:
        step: the step whose numbers are drawn (``seed * 1_000_003 + step`` seeds the
            generators); set by [`start`][vae_ddp.fixes.randomness.GlobalBatchStream.start].
        draws: number of [`draw`][vae_ddp.fixes.randomness.GlobalBatchStream.draw] calls since
            the stream was built (a fix uses it to tell whether the module drew at all).
    """

    def __init__(self, seed: Optional[int] = None, rank: Optional[int] = None,
                 world_size: Optional[int] = None) -> None:
        self.seed = _env.global_seed(seed)
        self.rank, self.world_size = _env.rank(rank), _env.world_size(world_size)
        self.step = 0
        self.draws = 0
        self._generators: dict[torch.device, torch.Generator] = {}

    def start(self, step: int, rank: Optional[int] = None, world_size: Optional[int] = None) -> "GlobalBatchStream":
        """Begin step ``step``: the next draw on each device starts from a generator seeded
        with ``seed * 1_000_003 + step``. Makes this stream the current one
        ([`current_stream`][vae_ddp.fixes.randomness.current_stream]) until
        [`stop`][vae_ddp.fixes.randomness.GlobalBatchStream.stop]."""
        self.step = int(step)
        if rank is not None:
            self.rank = int(rank)
        if world_size is not None:
            self.world_size = int(world_size)
        self._generators = {}
        _current.stream = self
        return self

    def stop(self) -> None:
        """End the step: [`global_batch_draw`][vae_ddp.fixes.randomness.global_batch_draw] draws as usual again."""
        if _current.stream is self:
            _current.stream = None
        self._generators = {}

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """The step's generator on ``device`` (created and seeded on first use in the step)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed * STEP_SEED_MULTIPLIER + self.step)
            self._generators[device] = g
        return g

    def draw(self, fn: Callable[..., Tensor], shape: Sequence[int], dtype: Optional[torch.dtype] = None,
             device: torch.device | str = "cpu", batch_dim: int = 0) -> Tensor:
        """This rank's rows of a global-batch draw.

        Args:
            fn: a torch factory with ``size`` and ``generator=, dtype=, device=`` keywords:
                ``torch.randn``, ``torch.rand``, or a ``functools.partial`` of
                ``torch.randint`` with its bounds.
            shape: the local shape, ``shape[batch_dim] = b`` (this rank's batch size).
            dtype: dtype of the result (``None``: torch's default dtype).
            device: device of the result.
            batch_dim: the batch dimension of ``shape`` (1 for sequence-first layouts).

        Returns:
            Tensor of ``shape``: rows ``[rank * b, (rank + 1) * b)`` along ``batch_dim`` of
            ``fn`` drawn at shape ``shape`` with ``N * b`` along ``batch_dim``.
        """
        shape = list(shape)
        b = shape[batch_dim]
        full = list(shape)
        full[batch_dim] = self.world_size * b
        dev = torch.device(device)
        out = fn(full, generator=self.generator(dev), dtype=dtype, device=dev)
        self.draws += 1
        if self.world_size == 1:
            return out
        return out.narrow(batch_dim, self.rank * b, b)


def current_stream() -> Optional[GlobalBatchStream]:
    """The stream of the running training step, or None outside one."""
    return _current.stream


def global_batch_draw(fn: Callable[..., Tensor], shape: Sequence[int], dtype: Optional[torch.dtype] = None,
                      device: torch.device | str = "cpu", batch_dim: int = 0) -> Tensor:
    """Draw ``fn(shape)`` from the running step's [`GlobalBatchStream`][vae_ddp.fixes.randomness.GlobalBatchStream]
    (this rank's rows of the global-batch draw), or from torch's default generator when no
    stream is running (validation, no fix installed). Same arguments as
    [`GlobalBatchStream.draw`][vae_ddp.fixes.randomness.GlobalBatchStream.draw]; the result has
    ``shape``, ``dtype`` and ``device``.

    Example, in a module's ``forward``: ``eps = global_batch_draw(torch.randn, mu.shape,
    mu.dtype, mu.device)``.
    """
    stream = _current.stream
    if stream is None:
        return fn(list(shape), dtype=dtype, device=torch.device(device))
    return stream.draw(fn, shape, dtype=dtype, device=device, batch_dim=batch_dim)


def uncovered_random_layers(module: nn.Module, dropout_covered: bool) -> list[str]:
    """Names of ``module``'s layers whose random draws a global-batch stream does not serve:
    ``nn.MultiheadAttention`` / ``nn.RNNBase`` with ``dropout > 0`` (they call the functional
    dropout inside), ``nn.AlphaDropout`` / ``nn.FeatureAlphaDropout``, and, when
    ``dropout_covered`` is False, every ``nn.Dropout``/``Dropout1d/2d/3d`` with ``p > 0`` and
    every drop-path layer ([`drop_path_layers`][vae_ddp.fixes.dropout.drop_path_layers]).
    Returns ``["name (Class)", ...]``."""
    found = []
    for name, m in module.named_modules():
        if isinstance(m, GlobalBatchDropout):
            continue
        if isinstance(m, (nn.AlphaDropout, nn.FeatureAlphaDropout)) and m.p > 0:
            found.append(f"{name} ({type(m).__name__})")
        elif isinstance(m, SWAPPABLE) and m.p > 0 and not dropout_covered:
            found.append(f"{name} ({type(m).__name__})")
        elif isinstance(m, (nn.MultiheadAttention, nn.RNNBase)) and getattr(m, "dropout", 0) > 0:
            found.append(f"{name} ({type(m).__name__}, dropout={m.dropout})")
    if not dropout_covered:
        names = {id(m): n for n, m in module.named_modules()}
        found += [f"{names[id(layer)]} ({type(layer).__name__})" for _, _, layer in drop_path_layers(module)]
    return found


_MISSING = object()


class GlobalBatchRandomness(Callback):
    """Lightning callback: every random draw of a training step made for the global batch.

    ``Trainer(callbacks=[GlobalBatchRandomness()])``. During ``fit``:

    - around each training batch (``on_train_batch_start`` / ``on_train_batch_end``) it
      starts and stops a [`GlobalBatchStream`][vae_ddp.fixes.randomness.GlobalBatchStream]
      at batch ``k`` (counted from the start of ``fit``), with the trainer's global rank and
      world size, so that [`global_batch_draw`][vae_ddp.fixes.randomness.global_batch_draw] and
      [`GlobalBatchDropout`][vae_ddp.fixes.dropout.GlobalBatchDropout] draw from it;
    - ``dropout=True``: in ``setup`` it replaces every ``nn.Dropout`` / ``Dropout1d/2d/3d``
      of the LightningModule by a [`GlobalBatchDropout`][vae_ddp.fixes.dropout.GlobalBatchDropout]
      and every per-sample drop-path layer (timm's ``DropPath``, torchvision's
      ``StochasticDepth(mode="row")``) by a [`GlobalBatchDropPath`][vae_ddp.fixes.dropout.GlobalBatchDropPath]
      (no parameters, so DDP is unaffected) and puts the originals back in ``teardown``
      (and on an exception);
    - ``noise=True``: if the module has a ``noise`` attribute (``eps = self.noise(mu)``, as
      [`VAE`][vae_ddp.model.VAE]), it serves it during training batches (``eps`` drawn with
      ``torch.randn`` from the stream) and restores it after each batch; a module without one
      is left without one;
    - at each training epoch start it calls ``set_epoch(trainer.current_epoch)`` on every
      [`SeededAugmentation`][vae_ddp.fixes.augmentation.SeededAugmentation] found in the
      training loaders' datasets (Lightning creates the epoch's DataLoader iterator, and so
      its worker processes, after this hook);
    - it warns once, on rank 0 (``rank_zero_warn``): at ``setup`` about random layers it
      cannot serve ([`uncovered_random_layers`][vae_ddp.fixes.randomness.uncovered_random_layers]),
      and at the end of the first training epoch (or of ``fit`` if sooner) if the module
      never drew from the stream.

    Args:
        seed: base seed, the same on every rank; default: ``seed_everything``'s seed
            (``PL_GLOBAL_SEED``) read at ``setup``, else 0.
        dropout: swap ``nn.Dropout`` layers for [`GlobalBatchDropout`][vae_ddp.fixes.dropout.GlobalBatchDropout]
            and drop-path layers for [`GlobalBatchDropPath`][vae_ddp.fixes.dropout.GlobalBatchDropPath].
        noise: serve the module's ``noise`` attribute.
        batch_dim: batch dimension of the activations the swapped dropout layers see (1
            for sequence-first models).
    """

    #: the name used in warnings
    fix_name = "GlobalBatchRandomness"

    def __init__(self, seed: Optional[int] = None, dropout: bool = True, noise: bool = True,
                 batch_dim: int = 0) -> None:
        self.seed = seed
        self.dropout, self.noise_attr, self.batch_dim = dropout, noise, batch_dim
        self.stream = GlobalBatchStream(0 if seed is None else seed, rank=0, world_size=1)
        self._batch = 0
        self._original_noise: Any = _MISSING
        self._swapped: list = []
        self._checked = False
        #: the ``SeededAugmentation``s found in the training loaders at an epoch's start (most of any epoch)
        self.augmentations = 0
        #: the layers swapped at the last ``setup`` (put back at ``teardown``)
        self.swapped = 0

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.stream.seed = _env.global_seed(self.seed)
        self.stream.rank, self.stream.world_size = trainer.global_rank, trainer.world_size
        self._checked = False
        self._original_noise = pl_module.__dict__.get("noise", _MISSING)
        if self.dropout:
            self._swapped = (GlobalBatchDropout.swap(pl_module, batch_dim=self.batch_dim)
                             + GlobalBatchDropPath.swap(pl_module))
        self.swapped = len(self._swapped)
        uncovered = uncovered_random_layers(pl_module, dropout_covered=self.dropout)
        if uncovered:
            rank_zero_warn(f"{self.fix_name} cannot serve the random draws of {', '.join(uncovered)}: they draw "
                           f"from each rank's own generator, so DDP draws differ from one device's"
                           + ("" if self.dropout else "; GlobalBatchRandomness() (dropout=True) covers nn.Dropout"),
                           category=UserWarning)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore(pl_module)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore(pl_module)

    def _restore(self, pl_module: LightningModule) -> None:
        self.stream.stop()
        self._restore_noise(pl_module)
        if self._swapped:
            GlobalBatchDropout.unswap(self._swapped)
            self._swapped = []

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._batch = 0
        self._draws_at_start = self.stream.draws
        self.augmentations = 0

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.augmentations = max(self.augmentations,
                                 set_augmentation_epoch(trainer.train_dataloader, trainer.current_epoch))

    @property
    def drawn(self) -> int:
        """Draws from the stream (``global_batch_draw``, the swapped layers, ``noise``) since ``fit`` started."""
        return self.stream.draws - getattr(self, "_draws_at_start", 0)

    # ------------------------------------------------------------------ per batch
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.stream.start(self._batch, trainer.global_rank, trainer.world_size)
        if self.noise_attr and hasattr(pl_module, "noise"):
            pl_module.noise = self

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.stream.stop()
        self._restore_noise(pl_module)
        self._batch += 1

    def _restore_noise(self, pl_module: LightningModule) -> None:
        """Put back the ``noise`` the module had at ``setup`` (none if it had no instance attribute)."""
        if pl_module.__dict__.get("noise") is self:
            if self._original_noise is _MISSING:
                del pl_module.noise
            else:
                pl_module.noise = self._original_noise

    def __call__(self, mu: Tensor) -> Tensor:
        """``eps`` for this rank's rows: same shape, dtype and device as ``mu: (b, latent_dim)``,
        drawn with ``torch.randn`` from the step's stream. Called outside a training batch it
        draws what batch ``self._batch`` would draw first (a fresh generator each call), so
        ``GlobalBatchNoise(seed)(torch.zeros(B, d))`` is one device's noise of batch 0."""
        if current_stream() is self.stream:
            return self.stream.draw(torch.randn, mu.shape, dtype=mu.dtype, device=mu.device)
        one_off = GlobalBatchStream(_env.global_seed(self.seed), self.stream.rank, self.stream.world_size)
        one_off.step = self._batch
        return one_off.draw(torch.randn, mu.shape, dtype=mu.dtype, device=mu.device)

    # ------------------------------------------------------------------ was it used?
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check_used(pl_module)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check_used(pl_module)

    def _check_used(self, pl_module: LightningModule) -> None:
        if self._checked or self._batch == 0:
            return
        self._checked = True
        if self.stream.draws == getattr(self, "_draws_at_start", 0):
            rank_zero_warn(f"{self.fix_name} is installed but {type(pl_module).__name__} never drew from it in "
                           f"{self._batch} training batches: {self._unused_hint(pl_module)}", category=UserWarning)

    def _unused_hint(self, pl_module: LightningModule) -> str:
        return ("its random draws (if any) do not go through global_batch_draw, GlobalBatchDropout or a "
                "`noise` attribute, so they stay the same on every rank")
