"""The three training configurations and the switches of each fix, as one ``RunSpec``.

- ``single``: 1 device, per-device batch size = global batch size.
- ``ddp``: Lightning's ``strategy="ddp"`` with N processes (gloo on CPU, NCCL on GPUs),
  per-device batch size = global batch size / N.
- ``dp``: Lightning 1.x DataParallel (see [`vae_ddp.studies.dp`][vae_ddp.studies.dp]): 1 process, the global
  batch scattered into N chunks.

Every configuration starts from ``seed_everything(seed)``, the same initial weights and
the same global batch size. The fixes are independent switches, all off by default
(Lightning's defaults); [`exact`][vae_ddp.studies.configs.RunSpec.exact] turns all of them on.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Optional

import torch

from vae_ddp.data import DATASETS, find_image_root
from vae_ddp.studies.dp import DP_MODES, resolve_dp_mode
from vae_ddp.errors import UserError
from vae_ddp.model import MODELS

__all__ = ["RunSpec", "CONFIGS", "NOISE_MODES", "DTYPES"]

CONFIGS = ("single", "ddp", "dp")
NOISE_MODES = ("default", "per_rank", "global")
DTYPES = ("float32", "float64")


@dataclass
class RunSpec:
    """Everything that defines one training run (JSON-serialisable).

    Attributes:
        config: ``single``, ``ddp`` or ``dp``.
        devices: world size N for ``ddp``, replicas for ``dp``; forced to 1 for ``single``.
        global_batch_size: samples per optimizer step over all devices (B).
        steps: optimizer steps (``Trainer(max_steps=...)``).
        seeds: one run per seed (``seed_everything(seed)``), in one launch.
        model: ``resnet18`` or ``small``. latent_dim: ``None`` = 256 (resnet18) or 32 (small).
        data, data_dir, max_samples: which images (see [`make_datamodule`][vae_ddp.data.make_datamodule]).
        dtype: ``float32`` or ``float64`` (Lightning ``precision="64-true"``).
        noise: ``default`` (same stream on every rank), ``per_rank`` ([`PerRankSeed`][vae_ddp.fixes.noise.PerRankSeed])
            or ``global`` ([`GlobalBatchNoise`][vae_ddp.fixes.noise.GlobalBatchNoise]).
        sync_bn: BatchNorm over the global batch (GPU: ``sync_batchnorm=True``; CPU:
            [`GlooSyncBatchNorm`][vae_ddp.fixes.batchnorm.GlooSyncBatchNorm]).
        sampler: ``default`` (RandomSampler / Lightning's DistributedSampler) or
            ``global`` ([`GlobalBatchDistributedSampler`][vae_ddp.fixes.sampler.GlobalBatchDistributedSampler]).
        sync_dist_logging: ``self.log(..., sync_dist=True)``.
        val_every: validation every this many steps (0: none).
        accelerator: ``cpu`` or ``gpu``.
        dp_mode: ``auto``, ``real`` or ``emulate`` (``dp`` only).
        save_params: write the final parameters and Adam's second moments (``params-<seed>.pt``).
        record_indices: record the dataset indices of every step's global batch.
        lr, kl_coeff, kl_estimator, optimizer: model hyper-parameters (bolts defaults; Adam).
        permute_seed: one device with ``noise="global"`` only: permute the samples inside each
            batch with this seed, each keeping its noise (the same loss, summed in another order;
            the reordering floor of [`equivalence`][vae_ddp.studies.equivalence.equivalence]). None: off.
        label: name used in progress lines and results.
    """

    config: str = "single"
    devices: int = 2
    global_batch_size: int = 256
    steps: int = 60
    seeds: list[int] = field(default_factory=lambda: [0])
    model: str = "small"
    latent_dim: Optional[int] = None
    data: str = "digits"
    data_dir: Optional[str] = None
    max_samples: Optional[int] = None
    dtype: str = "float32"
    noise: str = "default"
    sync_bn: bool = False
    sampler: str = "default"
    sync_dist_logging: bool = False
    val_every: int = 0
    accelerator: str = "cpu"
    dp_mode: str = "auto"
    save_params: bool = False
    record_indices: bool = False
    lr: float = 1e-4
    kl_coeff: float = 0.1
    kl_estimator: str = "mc"
    optimizer: str = "adam"
    permute_seed: Optional[int] = None
    label: str = ""

    @property
    def world_size(self) -> int:
        """Number of processes Lightning runs (1 for single and dp)."""
        return self.devices if self.config == "ddp" else 1

    @property
    def per_device_batch_size(self) -> int:
        """Batch size given to each process's DataLoader."""
        return self.global_batch_size // self.world_size

    def exact(self) -> "RunSpec":
        """A copy with every fix on: global-batch noise, synchronised BatchNorm, the
        global-batch sampler and synchronised logging."""
        return dataclasses.replace(self, noise="global", sync_bn=True, sampler="global", sync_dist_logging=True)

    def fixes(self) -> list[str]:
        """Names of the fixes that are on."""
        out = []
        if self.noise != "default":
            out.append(f"noise={self.noise}")
        if self.sync_bn:
            out.append("sync_bn")
        if self.sampler != "default":
            out.append(f"sampler={self.sampler}")
        if self.sync_dist_logging:
            out.append("sync_dist")
        return out

    def validate(self) -> "RunSpec":
        """Check the input before any work; returns a normalised copy.

        Raises:
            UserError: one line saying what is wrong and what to do.
        """
        if self.config not in CONFIGS:
            raise UserError(f"unknown configuration {self.config!r}: use one of {', '.join(CONFIGS)}")
        if self.model not in MODELS:
            raise UserError(f"unknown model {self.model!r}: use one of {', '.join(MODELS)}")
        if self.data not in DATASETS:
            raise UserError(f"unknown data {self.data!r}: use one of {', '.join(DATASETS)}")
        if self.noise not in NOISE_MODES:
            raise UserError(f"unknown noise mode {self.noise!r}: use one of {', '.join(NOISE_MODES)}")
        if self.optimizer not in ("adam", "sgd"):
            raise UserError(f"unknown optimizer {self.optimizer!r}: use adam or sgd")
        if self.dtype not in DTYPES:
            raise UserError(f"unknown dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")
        if self.dp_mode not in DP_MODES:
            raise UserError(f"unknown --dp mode {self.dp_mode!r}: use one of {', '.join(DP_MODES)}")
        if self.steps < 1:
            raise UserError(f"--steps must be at least 1, got {self.steps}")
        if self.devices < 1:
            raise UserError(f"--devices must be at least 1, got {self.devices}")
        if self.lr <= 0:
            raise UserError(f"--lr must be positive, got {self.lr}")
        if self.val_every < 0:
            raise UserError(f"--val-every must be 0 (never) or positive, got {self.val_every}")
        if self.max_samples is not None and self.max_samples < 2 * self.global_batch_size:
            raise UserError(f"--max-samples {self.max_samples} is too small for global batch size "
                            f"{self.global_batch_size}: use at least {2 * self.global_batch_size} (20% go to validation)")
        if self.global_batch_size < 1:
            raise UserError(f"--global-batch-size must be at least 1, got {self.global_batch_size}")
        if self.config in ("ddp", "dp") and self.global_batch_size % self.devices:
            raise UserError(f"global batch size {self.global_batch_size} is not divisible by {self.devices} "
                            f"devices: pick a multiple of {self.devices} (per-device batch = global / devices)")
        if self.accelerator == "gpu" and torch.cuda.device_count() < self.world_size:
            raise UserError(f"--accelerator gpu with {self.world_size} devices needs that many CUDA devices, "
                            f"this machine has {torch.cuda.device_count()}: use --accelerator cpu")
        spec = dataclasses.replace(self, devices=1 if self.config == "single" else self.devices)
        if self.config == "dp":
            try:
                spec.dp_mode = resolve_dp_mode(self.dp_mode, self.devices)
            except ValueError as err:
                raise UserError(str(err)) from None
        if self.data == "imagefolder":
            if not self.data_dir:
                raise UserError("--data imagefolder needs --data-dir DIR, e.g. ../shared/data/cifar10-jpg-subset")
            find_image_root(self.data_dir)
        if spec.latent_dim is None:
            spec.latent_dim = 256 if self.model == "resnet18" else 32
        if not spec.label:
            spec.label = self.config if not spec.fixes() else f"{self.config}+fixed"
        return spec

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        return cls(**json.loads(text))
