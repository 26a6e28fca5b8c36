"""The three training configurations and the switches of each fix, as one ``RunSpec``.

- ``single``: 1 device, per-device batch size = global batch size.
- ``ddp``: Lightning's ``strategy="ddp"`` with N processes (gloo on CPU, NCCL on GPUs),
  per-device batch size = global batch size / N.
- ``dp``: Lightning 1.x DataParallel (see [`vae_ddp.dp`][vae_ddp.dp]): 1 process, the global
  batch scattered into N chunks.

Every configuration starts from ``seed_everything(seed)``, the same initial weights and
the same global batch size. The fixes are independent switches, all off by default
(Lightning's defaults); [`exact`][vae_ddp.harness.configs.RunSpec.exact] turns all of them on.
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import torch

from vae_ddp.data import DATASETS, find_image_root
from vae_ddp.errors import UserError
from vae_ddp.fixes import registry
from vae_ddp.model import MODELS
from vae_ddp.dp import DP_MODES, resolve_dp_mode

__all__ = ["RunSpec", "CONFIGS", "choice_error", "flag", "in_flags"]

CONFIGS = ("single", "ddp", "dp")

#: parameters whose ``vae-ddp`` flag is not ``--`` + the name (``vae_ddp.cli``)
FLAGS = {"out_dir": "--out"}


def flag(name: str) -> str:
    """The ``vae-ddp`` flag of the RunSpec field (or study parameter) ``name``: jsonargparse's
    ``--name``, except for those of ``FLAGS``."""
    return FLAGS.get(name, "--" + name)


def in_flags(message: str) -> str:
    """A library error message in the words of ``vae-ddp``: each RunSpec field it names becomes
    its flag (``data_dir`` -> ``--data_dir``, ``data='cifar10'`` -> ``--data cifar10``; ``out_dir`` -> ``--out``).

    Only field names written as identifiers are replaced: those with an underscore
    (``data_dir``), and any field followed by ``='value'``; a plain word such as ``data`` or
    ``steps`` in the text, and a name inside a path (``/tmp/data_dir/x``), are left alone.
    """
    names = "|".join(sorted([f.name for f in dataclasses.fields(RunSpec)] + list(FLAGS), key=len, reverse=True))
    message = re.sub(rf"(?<![\w./-])({names})='([^']*)'", lambda m: f"{flag(m[1])} {m[2]}", message)
    return re.sub(rf"(?<![\w./-])({names})(?![\w=/-])", lambda m: flag(m[1]) if "_" in m[1] else m[1], message)


def choice_error(name: str, value: object, choices: tuple) -> UserError:
    """The one-line error for a value outside a ``Literal``'s choices."""
    return UserError(f"unknown {flag(name)} {value!r}: use one of {', '.join(map(str, choices))}")


@dataclass
class RunSpec:
    """Everything that defines one training run (JSON-serialisable).

    Attributes:
        config: ``single``, ``ddp`` or ``dp``.
        devices: world size N for ``ddp``, replicas for ``dp``; forced to 1 for ``single``.
        global_batch_size: samples per optimizer step over all devices (B).
        steps: optimizer steps (``Trainer(max_steps=...)``).
        seeds: one run per seed (``seed_everything(seed)``), in one launch.
        model: ``resnet18`` (bolts' ResNet-18 encoder/decoder) or ``small`` (a small conv VAE).
        latent_dim: ``None`` = 256 (resnet18) or 32 (small).
        data: ``digits`` (bundled), ``cifar10`` (torchvision) or ``imagefolder``
            (see [`make_datamodule`][vae_ddp.data.make_datamodule]).
        data_dir: ImageFolder root for ``imagefolder``, CIFAR-10 root for ``cifar10``.
        max_samples: use a fixed random subset of this many images (None: all).
        dtype: ``float32`` or ``float64`` (Lightning ``precision="64-true"``).
        noise: ``default`` (same stream on every rank), ``per_rank`` ([`PerRankSeed`][vae_ddp.fixes.noise.PerRankSeed])
            or ``global`` ([`GlobalBatchNoise`][vae_ddp.fixes.noise.GlobalBatchNoise]).
        sync_bn: BatchNorm over the global batch (GPU: ``sync_batchnorm=True``; CPU:
            [`GlobalSyncBatchNorm`][vae_ddp.fixes.batchnorm.GlobalSyncBatchNorm]).
        sampler: ``default`` (RandomSampler / Lightning's DistributedSampler) or
            ``global`` ([`GlobalBatchDistributedSampler`][vae_ddp.fixes.sampler.GlobalBatchDistributedSampler]).
        sync_dist_logging: ``self.log(..., sync_dist=True)``.
        val_every: validation every this many steps (0: none).
        accelerator: ``cpu`` or ``gpu``.
        dp_mode: ``auto``, ``real`` or ``emulate`` (``dp`` only).
        save_params: write the final parameters and Adam's second moments (``params-<seed>.pt``).
        record_indices: record the dataset indices of every step's global batch.
        lr: learning rate (the report's 1e-4).
        kl_coeff: weight of the KL term (bolts' 0.1).
        kl_estimator: ``mc`` (one-sample Monte Carlo, bolts') or ``analytic``.
        optimizer: ``adam`` (the report's) or ``sgd``.
        permute_seed: one device only: permute the samples inside each batch with this seed,
            each keeping its noise (the same loss, summed in another order: the reordering
            floor of `equivalence`). None: off.
        steps_file: per-step record of the run (``StepProbe``): the reference run (not
            ``teacher_forced``) writes its weights θ_k and gradients of every step there; a
            ``teacher_forced`` run reads the weights from it and starts every step from them,
            writing its own gradients beside its parameters (``steps-<seed>.pt``). None: off.
        teacher_forced: start every step from the weights recorded in ``steps_file``.
        init_weights: a file of weights every seed starts from instead of its initial ones (the model's
            ``state_dict``, or ``{"state_dict": ...}`` as ``save_params`` writes it, e.g. one device's
            final weights of an earlier run; the same architecture, every key), so that a step is
            compared from trained weights. The seed still seeds the data order and the noise.
            None: the initial weights of ``seed_everything(seed)``.
        label: name used in progress lines and results.
    """

    config: Literal["single", "ddp", "dp"] = "single"
    devices: int = 2
    global_batch_size: int = 256
    steps: int = 60
    seeds: list[int] = field(default_factory=lambda: [0])
    model: Literal[MODELS] = "small"
    latent_dim: Optional[int] = None
    data: Literal[DATASETS] = "digits"
    data_dir: Optional[str] = None
    max_samples: Optional[int] = None
    dtype: Literal["float32", "float64"] = "float32"
    noise: Literal["default", "per_rank", "global"] = "default"
    sync_bn: bool = False
    sampler: Literal["default", "global"] = "default"
    sync_dist_logging: bool = False
    val_every: int = 0
    accelerator: Literal["cpu", "gpu"] = "cpu"
    dp_mode: Literal[DP_MODES] = "auto"
    save_params: bool = False
    record_indices: bool = False
    lr: float = 1e-4
    kl_coeff: float = 0.1
    kl_estimator: Literal["mc", "analytic"] = "mc"
    optimizer: Literal["adam", "sgd"] = "adam"
    permute_seed: Optional[int] = None
    steps_file: Optional[str] = None
    teacher_forced: bool = False
    init_weights: Optional[str] = None
    label: str = ""

    @property
    def world_size(self) -> int:
        """Number of processes Lightning runs (1 for single and dp)."""
        return self.devices if self.config == "ddp" else 1

    @property
    def per_device_batch_size(self) -> int:
        """Batch size given to each process's DataLoader."""
        return self.global_batch_size // self.world_size

    def param_bytes(self) -> int:
        """Bytes of the parameters of this run's model, counted on a model built on torch's ``meta``
        device (no memory, milliseconds): what [`check_memory`][vae_ddp.harness.resources.check_memory]
        counts per rank."""
        return sum(p.numel() for p in self.meta_model().parameters()) * (8 if self.dtype == "float64" else 4)

    def saved_bytes(self) -> int:
        """Bytes of the tensors this run writes at most ([`space_needed`][vae_ddp.harness.resources.space_needed]
        adds its logs): per seed, with ``save_params`` its parameters with Adam's second moments
        (2 x parameters), with ``steps_file`` its per-step gradients and weights (3 x parameters
        x steps); 0 when it saves neither."""
        if not (self.save_params or self.steps_file):
            return 0
        per_seed = (2 if self.save_params else 0) + (3 * self.steps if self.steps_file else 0)
        return len(self.seeds) * self.param_bytes() * per_seed

    def exact(self) -> "RunSpec":
        """A copy with every fix on: each switch of the factor registry
        ([`vae_ddp.fixes.registry`][vae_ddp.fixes.registry]) at its ``fixed`` value (global-batch noise,
        synchronised BatchNorm, the global-batch sampler, synchronised logging)."""
        return dataclasses.replace(self, **{f.field: f.fixed for f in registry.switches()})

    def fixes(self) -> list[str]:
        """Names of the fixes that are on (``noise=global``, ``sync_bn``, ...), in registry order."""
        return [f.label(self) for f in registry.switches() if f.is_on(self)]

    @classmethod
    def choices(cls) -> dict[str, tuple]:
        """``{field: allowed values}`` of every ``Literal``-typed field (the single source of the choices)."""
        hints = typing.get_type_hints(cls)
        return {f.name: typing.get_args(hints[f.name]) for f in dataclasses.fields(cls)
                if typing.get_origin(hints[f.name]) is Literal}

    def validate(self) -> "RunSpec":
        """Check the input before any work; returns a normalised copy.

        Raises:
            UserError: one line saying what is wrong and what to do.
        """
        for name, allowed in self.choices().items():
            if getattr(self, name) not in allowed:
                raise choice_error(name, getattr(self, name), allowed)
        if self.steps < 1:
            raise UserError(f"--steps must be at least 1, got {self.steps}")
        if self.devices < 1:
            raise UserError(f"--devices must be at least 1, got {self.devices}")
        if self.lr <= 0:
            raise UserError(f"--lr must be positive, got {self.lr}")
        if self.val_every < 0:
            raise UserError(f"--val_every must be 0 (never) or positive, got {self.val_every}")
        if self.max_samples is not None and self.max_samples < 2 * self.global_batch_size:
            raise UserError(f"--max_samples {self.max_samples} is too small for global batch size "
                            f"{self.global_batch_size}: use at least {2 * self.global_batch_size} "
                            "(20% go to validation)")
        if self.global_batch_size < 1:
            raise UserError(f"--global_batch_size must be at least 1, got {self.global_batch_size}")
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
                raise UserError(in_flags(str(err))) from None
        if self.data == "imagefolder":
            if not self.data_dir:
                raise UserError("--data imagefolder needs --data_dir DIR, an ImageFolder tree such as the "
                                "CIFAR-10 subset built by .github/scripts/cifar10-subset.sh")
            try:
                find_image_root(self.data_dir)
            except (ValueError, OSError) as err:
                raise UserError(in_flags(str(err))) from None
        if spec.latent_dim is None:
            spec.latent_dim = 256 if self.model == "resnet18" else 32
        if spec.init_weights is not None:
            initial_weights(spec)  # read and checked against the model before any run starts
        if not spec.label:
            spec.label = self.config if not spec.fixes() else f"{self.config}+fixed"
        return spec

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    def meta_model(self) -> torch.nn.Module:
        """This run's model built on torch's ``meta`` device (no memory, milliseconds)."""
        from vae_ddp.model import VAE

        with torch.device("meta"):
            return VAE(input_height=32, enc_type=self.model, latent_dim=self.latent_dim or 32)

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        return cls(**json.loads(text))


def initial_weights(spec: RunSpec) -> dict[str, torch.Tensor]:
    """The state dict of ``spec.init_weights`` (memory-mapped, on the CPU), checked against the model of
    ``spec`` (the same keys and shapes; ``latent_dim`` resolved).

    Raises:
        UserError: the file is missing, is not a file of tensors ``torch.load`` reads with
            ``weights_only=True``, or does not fit the model (one line: the first key that differs).
    """
    path = Path(spec.init_weights)
    if not path.is_file():
        raise UserError(f"--init_weights {spec.init_weights}: no such file: give a weights file an earlier run "
                        "wrote (e.g. one device's params-0.pt)")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001  (any unreadable file is the user's input)
        raise UserError(f"--init_weights {spec.init_weights}: not a weights file torch.load reads "
                        f"({type(err).__name__}): give a state dict or a params-<seed>.pt file") from None
    state = saved.get("state_dict", saved) if isinstance(saved, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"--init_weights {spec.init_weights}: holds no state dict: give a state dict or a "
                        "params-<seed>.pt file")
    expected = {k: tuple(v.shape) for k, v in spec.meta_model().state_dict().items()}
    for key in sorted(set(expected) | set(state)):
        shape = tuple(state[key].shape) if key in state else None
        if shape != expected.get(key):
            raise UserError(f"--init_weights {spec.init_weights} does not fit --model {spec.model} (latent "
                            f"{spec.latent_dim}): {key} is {shape or 'missing'} in the file, "
                            f"{expected.get(key) or 'absent'} in the model")
    return state
