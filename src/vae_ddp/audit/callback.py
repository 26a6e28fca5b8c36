"""``DDPAudit``: a passive check a user adds to their own DDP training.

It looks at the start of training (again after the first training batch, for what
``self.log`` registered, and at the end of the first validation epoch) for the factors that make
DDP on N devices differ from one device with the same global batch, and warns on rank 0 with the fix and the page that
explains it. It changes nothing in the run: its only random draw is made inside
``torch.random.fork_rng`` so every generator is left where it was.

Add it to the ``Trainer`` of a real run: ``Trainer(strategy="ddp", devices=2, callbacks=[DDPAudit()])``.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

from pytorch_lightning import Callback, LightningModule, Trainer

from vae_ddp.fixes import registry
from vae_ddp.fixes.factor import Finding, Seen, gather_digest

__all__ = ["DDPAudit", "Finding"]


class DDPAudit(Callback):
    """Check a DDP run once for the known factors; warn on rank 0.

    The checks are the factors' own (``watch`` of each [`Factor`][vae_ddp.fixes.factor.Factor],
    declared in its fix module and collected by [`vae_ddp.fixes.registry`][vae_ddp.fixes.registry]),
    run at the hooks of ``vae_ddp.fixes.factor.HOOKS``; ``parameters`` is the callback's own.
    Each needs world size > 1; on one device the callback does nothing:

    - ``noise``: every rank's global torch generator yields the same next draws (a hash of
      16 draws from a forked state, all-gathered) and the first training step draws from it
      (its state moved between ``on_train_batch_start`` and ``on_train_batch_end``): dropout
      masks and reparameterization noise repeat across ranks; skipped when a known noise
      fix (``GlobalBatchRandomness``, ``GlobalBatchNoise``, ``PerRankSeed``) is among the callbacks.
    - ``optimizer``: reported with ``noise`` when an optimizer has per-parameter step sizes (Adam,
      RMSprop, Adagrad, ...; not SGD): shared noise raises the variance of the averaged gradient,
      which changes its second moments and step sizes.
    - ``batchnorm``: BatchNorm layers that normalise with per-rank statistics (not
      ``torch.nn.SyncBatchNorm`` nor ``vae_ddp``'s ``GlobalBatchNorm``).
    - ``sampler``: a ``torch.utils.data.DistributedSampler`` (Lightning inserts one under
      DDP) that shuffles: its ranks get interleaved rows of a permutation other than a
      one-device ``RandomSampler``'s; and it pads the dataset with repeated samples up to a multiple
      of the world size (counted for the training and validation loaders); and a training
      ``DataLoader`` whose ``batch_size`` is not its ``GlobalBatchDistributedSampler``'s
      per-device batch (``DataLoader(batch_size=B)`` over a sampler of global batch ``B`` on
      N ranks trains with a global batch of ``N * B``); and, over the first 8 training
      batches, ranks whose batches differ in shape beyond the batch dimension (a ``collate_fn``
      that pads each per-device batch to its own longest row).
    - ``reduction``: padding also changes the mean: repeated samples count twice.
    - ``logging``: metrics logged with ``self.log(..., sync_dist=False)`` (the default):
      under DDP the logged value is rank 0's share of the batch, checked after the first
      training batch.
    - ``parameters``: parameters that differ across ranks at the start (a hash per rank).
    - ``logging`` again, at the end of the first validation epoch: metrics logged as tensors
      with ``sync_dist=True`` on ranks whose validation sample counts add up to a total the
      world size does not divide (an unpadded sampler): Lightning's epoch mean is then off by
      its integer average of the counts (Lightning issues #21838, #21859).

    Attributes:
        findings: list of [`Finding`][vae_ddp.fixes.factor.Finding], the same on every rank.

    Args:
        warn: emit one ``UserWarning`` per finding on rank 0 (default True).
    """

    def __init__(self, warn: bool = True) -> None:
        self.warn = warn
        self.findings: list[Finding] = []
        self._states: dict[str, dict] = {}
        self._first_batch_done = False
        self._val_checked = False

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.findings, self._states, self._first_batch_done = [], {}, False
        if trainer.world_size < 2:
            return
        found = self._watch("train_start", trainer, pl_module)
        found += self._check_parameters(pl_module)
        self._keep(trainer, found)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.world_size > 1:
            self._keep(trainer, self._watch("train_batch_start", trainer, pl_module, batch))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._first_batch_done or trainer.world_size < 2:
            return
        self._first_batch_done = True
        self._keep(trainer, self._watch("train_batch_end", trainer, pl_module, batch))

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if not trainer.sanity_checking and trainer.world_size > 1:
            self._keep(trainer, self._watch("validation_batch_end", trainer, pl_module, batch))

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._val_checked or trainer.sanity_checking or trainer.world_size < 2:
            return
        self._val_checked = True
        self._keep(trainer, self._watch("validation_epoch_end", trainer, pl_module))

    # ------------------------------------------------------------------ checks
    def _watch(self, hook: str, trainer: Trainer, pl_module: LightningModule, batch: Any = None) -> list[Finding]:
        """The findings of every factor that watches ``hook`` (registry order)."""
        found: list[Finding] = []
        for key, watch in registry.watchers(hook):
            found += watch(Seen(trainer, pl_module, batch, self._states.setdefault(key, {})))
        return found

    def _check_parameters(self, pl_module: LightningModule) -> list[Finding]:
        """Parameters that differ across ranks at the start (a hash per rank)."""
        h = hashlib.sha256()
        for p in pl_module.parameters():
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
        digest = gather_digest(h.digest())
        if len(set(digest)) < 2:
            return []
        return [Finding("parameters", f"parameters differ across ranks at the start ({len(set(digest))} distinct sets)",
                        "do not change parameters per rank after DistributedDataParallel wraps the model "
                        "(it broadcasts rank 0's at construction)")]

    # ------------------------------------------------------------------ output
    def _keep(self, trainer: Trainer, findings: list[Finding]) -> None:
        self.findings += findings
        if self.warn and trainer.is_global_zero:
            for f in findings:
                warnings.warn(f.message(), UserWarning, stacklevel=2)

    def state(self) -> list[dict]:
        """The findings as dicts (JSON-serialisable)."""
        return [f.to_dict() for f in self.findings]
