"""``DDPAudit``: a passive check a user adds to their own DDP training.

It looks at the start of training (again after the first training batch, for what
``self.log`` registered, and at the end of the first validation epoch) for the factors that make DDP on N devices differ from one
device with the same global batch, and warns on rank 0 with the fix and the page that
explains it. It changes nothing in the run: its only random draw is made inside
``torch.random.fork_rng`` so every generator is left where it was.

Add it to the ``Trainer`` of a real run: ``Trainer(strategy="ddp", devices=2, callbacks=[DDPAudit()])``.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from pytorch_lightning import Callback, LightningModule, Trainer
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DistributedSampler

from vae_ddp.audit.static import batch_tensors

__all__ = ["DDPAudit", "Finding"]


@dataclass
class Finding:
    """One factor the run is exposed to.

    Attributes:
        factor: the factor's short name (``noise``, ``batchnorm``, ``sampler``,
            ``reduction``, ``logging``, ``optimizer``, ``parameters``).
        evidence: what was seen, with the numbers (one line).
        fix: the change, plain Lightning/torch first, then the ``vae_ddp`` helper.
        page: the documentation page that measures the factor (relative to the site root); by
            default the registry's page of the factor (``recipe.md`` for ``parameters``).
    """

    factor: str
    evidence: str
    fix: str
    page: str = ""

    def __post_init__(self) -> None:
        if not self.page:
            self.page = _registered(self.factor).page if _registered(self.factor) else "recipe.md"

    def message(self) -> str:
        """``DDPAudit [Random streams per rank]: ... Fix: ... (see factors/noise.md)``: the
        factor under its registry name (one name everywhere)."""
        name = _registered(self.factor).name if _registered(self.factor) else self.factor
        return f"DDPAudit [{name}]: {self.evidence}. Fix: {self.fix} (see {self.page})"


def _registered(key: str):
    """The registry's factor of ``key`` (None for the audit's own checks, e.g. ``parameters``)."""
    from vae_ddp.fixes import registry

    return next((f for f in registry.factors() if f.key == key), None)


_NOISE_FIXES = ("GlobalBatchNoise", "GlobalBatchRandomness", "PerRankSeed")
_SYNC_BN = ("SyncBatchNorm", "GlobalBatchNorm")


class DDPAudit(Callback):
    """Check a DDP run once for the known factors; warn on rank 0.

    Checks (each needs world size > 1; on one device the callback does nothing):

    - ``noise``: every rank's global torch generator yields the same next draws (a hash of
      16 draws from a forked state, all-gathered) and the first training step draws from it
      (its state moved between ``on_train_batch_start`` and ``on_train_batch_end``): dropout
      masks and reparameterization noise repeat across ranks; skipped when a known noise
      fix (``GlobalBatchRandomness``, ``GlobalBatchNoise``, ``PerRankSeed``) is among the callbacks.
    - ``optimizer``: reported with ``noise``: shared noise raises the variance of the
      averaged gradient, which changes Adam's second moments and step sizes.
    - ``batchnorm``: BatchNorm layers that normalise with per-rank statistics (not
      ``torch.nn.SyncBatchNorm`` nor ``vae_ddp``'s ``GlobalBatchNorm``).
    - ``sampler``: a ``torch.utils.data.DistributedSampler`` (Lightning inserts one under
      DDP) that shuffles: its ranks get interleaved rows of a permutation other than a
      one-device ``RandomSampler``'s; and it pads the dataset with repeated samples up to a multiple
      of the world size (counted for the training and validation loaders); and a training
      ``DataLoader`` whose ``batch_size`` is not its ``GlobalBatchDistributedSampler``'s
      per-device batch (``DataLoader(batch_size=B)`` over a sampler of global batch ``B`` on
      N ranks trains with a global batch of ``N * B``).
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
        findings: list of [`Finding`][vae_ddp.audit.callback.Finding], the same on every rank.

    Args:
        warn: emit one ``UserWarning`` per finding on rank 0 (default True).
    """

    def __init__(self, warn: bool = True) -> None:
        self.warn = warn
        self.findings: list[Finding] = []
        self._logging_checked = False
        self._streams_shared = False
        self._served = False
        self._rng_before: Optional[list[torch.Tensor]] = None
        self._val_samples = 0
        self._val_checked = False

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.findings = []
        self._logging_checked = False
        if trainer.world_size < 2:
            return
        self._check_noise(trainer, pl_module)
        self._check_batchnorm(pl_module)
        self._check_sampler(trainer)
        self._check_parameters(trainer, pl_module)
        self._report(trainer, self.findings)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._logging_checked and self._streams_shared:
            self._rng_before = _rng_states(pl_module)
            self._device = pl_module

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._logging_checked or trainer.world_size < 2:
            return
        self._logging_checked = True
        before = len(self.findings)
        self._check_draws(trainer)
        self._check_logging(trainer)
        self._report(trainer, self.findings[before:])

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if not trainer.sanity_checking:
            tensors = batch_tensors(batch)
            self._val_samples += len(tensors[0]) if tensors and tensors[0].dim() > 0 else 0

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._val_checked or trainer.sanity_checking or trainer.world_size < 2:
            return
        self._val_checked = True
        before = len(self.findings)
        self._check_epoch_mean(trainer)
        self._report(trainer, self.findings[before:])

    # ------------------------------------------------------------------ checks
    def _check_epoch_mean(self, trainer: Trainer) -> None:
        """Validation metrics logged as tensors with ``sync_dist=True`` on ranks whose sample
        counts add up to a total the world size does not divide: Lightning averages the ranks'
        counts in an integer tensor at the epoch end (``cumulated_batch_size``, Lightning 2.x;
        issues #21838, #21859), so the epoch mean is too large by ``(total / N) / floor(total / N)``."""
        results = trainer._results  # the validation loop's _ResultCollection here (Lightning 2.x)
        names = sorted({m.meta.name for m in (results.values() if results is not None else [])
                        if getattr(m, "is_tensor", False) and m.meta.sync.should and m.meta.on_epoch})
        counts = _gather_ints(trainer, self._val_samples)
        n, total = len(counts), sum(counts)
        if not names or n < 2 or total % n == 0:
            return
        factor = (total / n) / (total // n)
        self.findings.append(Finding(
            "logging", f"validation: the ranks hold {', '.join(map(str, counts))} samples ({total} in all) and log "
            f"{', '.join(names[:4])} with sync_dist=True: Lightning averages the ranks' counts in an integer tensor "
            f"at the epoch end, so the epoch mean is {factor:.4g}x the true mean (Lightning issues #21838, #21859)",
            "log a torchmetrics.MeanMetric updated with (value, weight=batch size) as an object, "
            "self.log(name, metric), whose states are summed over the ranks (vae_ddp.fixes.evaluation)"))

    def _check_noise(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Same next draws on every rank? (the hash of 16 draws from a forked generator)"""
        names = {type(c).__name__ for c in trainer.callbacks}
        self._streams_shared = False
        # with GlobalBatchRandomness the generators are still alike: a draw from them in the
        # step is one the fix does not serve (it serves dropout layers and a `noise` attribute)
        self._served = bool(names & {"GlobalBatchNoise", "GlobalBatchRandomness"})
        if names & set(_NOISE_FIXES) and not self._served:
            return
        devices = [pl_module.device] if pl_module.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            draw = torch.rand(16, device=pl_module.device, dtype=torch.float64)
        self._streams_shared = len(set(_gather_digest(trainer, draw.cpu().numpy().tobytes()))) == 1

    def _check_draws(self, trainer: Trainer) -> None:
        """Did the first training step draw from the shared global generator?"""
        if not self._streams_shared or self._rng_before is None:
            return
        if all(torch.equal(a, b) for a, b in zip(self._rng_before, _rng_states(self._device))):
            return  # the training step draws no random numbers from torch's global generator
        if self._served:
            self.findings.append(Finding(
                "noise", f"the training step draws random numbers from torch's global generator that "
                "GlobalBatchRandomness does not serve (it serves nn.Dropout layers and a `noise` attribute): "
                f"all {trainer.world_size} ranks draw the same ones, not this rank's share of the global batch's "
                "(torch.randn in training_step, drop-path, dropout inside scaled_dot_product_attention, ...)",
                "draw them for the global batch and keep this rank's rows: "
                "x = vae_ddp.fixes.global_batch_draw(torch.randn, shape) (under GlobalBatchRandomness), "
                "or swap the layer for one that does"))
            return
        self.findings.append(Finding(
            "noise", f"the training step draws random numbers and all {trainer.world_size} ranks draw the same "
            "ones (same torch seed): dropout masks and reparameterization noise repeat across ranks",
            "draw the randomness of the global batch and keep this rank's rows (a torch.Generator seeded "
            "alike on every rank), or seed each rank differently (torch.manual_seed(seed + rank) in "
            "setup); vae_ddp.fixes.GlobalBatchRandomness (dropout and noise) / PerRankSeed"))
        self.findings.append(Finding(
            "optimizer", "shared noise across ranks raises the variance of the averaged gradient, which "
            "changes Adam's second moments and step sizes", "the noise fix above"))

    def _check_batchnorm(self, pl_module: LightningModule) -> None:
        local = [n for n, m in pl_module.named_modules()
                 if isinstance(m, _BatchNorm) and type(m).__name__ not in _SYNC_BN and m.training]
        if local:
            shown = ", ".join(local[:3]) + (f" and {len(local) - 3} more" if len(local) > 3 else "")
            self.findings.append(Finding(
                "batchnorm", f"{len(local)} BatchNorm layer(s) normalise with per-rank statistics ({shown})",
                "Trainer(sync_batchnorm=True) on GPUs; on CPU/gloo "
                "Trainer(plugins=[vae_ddp.fixes.GlobalSyncBatchNorm()])"))

    def _check_sampler(self, trainer: Trainer) -> None:
        for dl in _loader_list(trainer.train_dataloader):
            s = _samplers(dl)[0] if _samplers(dl) else None
            per_device = getattr(s, "per_device_batch_size", None)
            bs = getattr(dl, "batch_size", None)
            if per_device is not None and bs is not None and bs != per_device:
                self.findings.append(Finding(
                    "sampler", f"DataLoader(batch_size={bs}) over {type(s).__name__}(global_batch_size="
                    f"{s.global_batch_size}) on {s.num_replicas} ranks: each rank takes {bs} samples per step, a "
                    f"global batch of {bs * s.num_replicas}, not {s.global_batch_size}",
                    f"DataLoader(dataset, batch_size=sampler.per_device_batch_size, sampler=sampler), here "
                    f"batch_size={per_device}"))
        train = _samplers(trainer.train_dataloader)
        for s in train:
            if not isinstance(s, DistributedSampler) or type(s).__name__ == "GlobalBatchDistributedSampler":
                continue
            if not s.shuffle:
                continue  # dataset order interleaved: the union of step k's batches is the one-device batch k
            self.findings.append(Finding(
                "sampler", f"{type(s).__name__}(shuffle=True) deals interleaved rows (indices[rank::{s.num_replicas}]) "
                "of its own permutation, not the one-device order (Lightning 2.x shuffles the training "
                "DistributedSampler even for DataLoader(shuffle=False))",
                "deal each single-device global batch to the ranks in contiguous chunks with "
                "Trainer(use_distributed_sampler=False) and a sampler of your own; "
                "vae_ddp.fixes.GlobalBatchDistributedSampler"))
            break
        padded = []
        for where, loaders in (("train", train), ("validation", _samplers(trainer.val_dataloaders))):
            for s in loaders:
                if isinstance(s, DistributedSampler) and not s.drop_last and s.total_size > len(s.dataset):
                    padded.append(f"{where}: {s.total_size - len(s.dataset)} repeated of {len(s.dataset)}")
        if padded:
            self.findings.append(Finding(
                "reduction", "DistributedSampler pads to a multiple of the world size, repeated samples count "
                f"twice in the mean ({'; '.join(padded)})",
                "drop_last=True for training; for evaluation an unrepeated sampler with metrics that sum "
                "their states across ranks (torchmetrics)"))

    def _check_parameters(self, trainer: Trainer, pl_module: LightningModule) -> None:
        h = hashlib.sha256()
        for p in pl_module.parameters():
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
        digest = _gather_digest(trainer, h.digest())
        if len(set(digest)) > 1:
            self.findings.append(Finding(
                "parameters", f"parameters differ across ranks at the start ({len(set(digest))} distinct sets)",
                "do not change parameters per rank after DistributedDataParallel wraps the model "
                "(it broadcasts rank 0's at construction)"))

    def _check_logging(self, trainer: Trainer) -> None:
        results = trainer._results  # the active loop's _ResultCollection (Lightning 2.x)
        if results is None:
            return
        unsynced = sorted({m.meta.name for m in results.values()
                           if getattr(m, "is_tensor", False) and not m.meta.sync.should})
        if unsynced:
            self.findings.append(Finding(
                "logging", f"{len(unsynced)} metric(s) logged without sync_dist ({', '.join(unsynced[:4])}): "
                "under DDP the logged value is rank 0's share of the batch",
                "self.log(name, value, sync_dist=True, batch_size=len(batch[0]))"))

    # ------------------------------------------------------------------ output
    def _report(self, trainer: Trainer, findings: list[Finding]) -> None:
        if self.warn and trainer.is_global_zero:
            for f in findings:
                warnings.warn(f.message(), UserWarning, stacklevel=2)

    def state(self) -> list[dict]:
        """The findings as dicts (JSON-serialisable)."""
        return [asdict(f) for f in self.findings]


def _rng_states(pl_module: LightningModule) -> list[torch.Tensor]:
    """The global CPU generator's state, and the module's CUDA device's when on a GPU."""
    states = [torch.get_rng_state()]
    if pl_module.device.type == "cuda":
        states.append(torch.cuda.get_rng_state(pl_module.device))
    return states


def _loader_list(loaders: Optional[Any]) -> list:
    """A DataLoader, a list of them, or a dict of them, as a list."""
    if loaders is None:
        return []
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]


def _samplers(loaders: Optional[Any]) -> list:
    """The samplers of a DataLoader, a list of them, or a dict of them (CombinedLoader flattened)."""
    out = []
    for dl in _loader_list(loaders):
        s = getattr(dl, "sampler", None)
        bs = getattr(dl, "batch_sampler", None)
        if bs is not None and getattr(bs, "sampler", None) is not None:
            s = bs.sampler
        if s is not None:
            out.append(s)
    return out


def _gather_ints(trainer: Trainer, value: int) -> list[int]:
    """``value`` from every rank (all_gather_object over the process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list[Optional[int]] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return [int(v) for v in out if v is not None]


def _gather_digest(trainer: Trainer, payload: bytes) -> list[bytes]:
    """``payload``'s sha256 digest from every rank (all_gather_object over the process group)."""
    digest = hashlib.sha256(payload).digest()
    if not (dist.is_available() and dist.is_initialized()):
        return [digest]
    out: list[Optional[bytes]] = [None] * dist.get_world_size()
    dist.all_gather_object(out, digest)
    return [d for d in out if d is not None]
