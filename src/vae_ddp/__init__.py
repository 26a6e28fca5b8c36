"""vae-ddp: why DDP on N devices with per-device batch B/N does not reproduce one device.

The library: the lightning-bolts CIFAR-10 VAE ported to Lightning 2.x ([`VAE`][vae_ddp.model.VAE]), its
data modules, the fixes of each factor ([`vae_ddp.fixes`][vae_ddp.fixes]) and the probes that measure
them ([`vae_ddp.probes`][vae_ddp.probes]). The studies and the ``vae-ddp`` command live in
[`vae_ddp.studies`][vae_ddp.studies] and [`vae_ddp.cli`][vae_ddp.cli].

Importing the package has no side effects and is cheap: the names below are imported on
first use (PEP 562 module ``__getattr__``), so ``import vae_ddp`` does not even import
torch. (``import pytorch_lightning`` itself imports matplotlib through sympy; this package
never selects a matplotlib backend, sets a warnings filter or seeds a generator at import.)
"""

from __future__ import annotations

import importlib
import os
from typing import Any

if os.environ.get("VAE_DDP_LIGHTNING"):  # an audit's run of a module built on lightning.pytorch
    from vae_ddp.lightning_package import install as _install

    _install()

__version__ = "0.1.0"

#: public name -> module that defines it
_EXPORTS = {
    "VAE": "vae_ddp.model", "vae_loss": "vae_ddp.model",
    "CIFAR10DataModule": "vae_ddp.data", "DigitsDataModule": "vae_ddp.data",
    "ImageFolderDataModule": "vae_ddp.data", "make_datamodule": "vae_ddp.data",
    "GlobalBatchDistributedSampler": "vae_ddp.fixes", "GlobalBatchNoise": "vae_ddp.fixes",
    "GlobalBatchNorm": "vae_ddp.fixes", "GlobalSyncBatchNorm": "vae_ddp.fixes", "PerRankSeed": "vae_ddp.fixes",
    "GlobalBatchRandomness": "vae_ddp.fixes", "GlobalBatchStream": "vae_ddp.fixes",
    "global_batch_draw": "vae_ddp.fixes", "GlobalBatchDropout": "vae_ddp.fixes",
    "GlobalBatchDropPath": "vae_ddp.fixes", "SeededAugmentation": "vae_ddp.fixes",
    "global_item_count": "vae_ddp.fixes", "global_item_mean": "vae_ddp.fixes",
    "global_token_cross_entropy": "vae_ddp.fixes", "unrepeated_sampler": "vae_ddp.fixes",
    "padded_duplicates": "vae_ddp.fixes",
    "GradientProbe": "vae_ddp.probes", "NoiseProbe": "vae_ddp.probes",
    "GlobalBatchRecorder": "vae_ddp.recording", "evaluate": "vae_ddp.recording",
    "UserError": "vae_ddp.errors", "quiet": "vae_ddp.utils", "DDPAudit": "vae_ddp.audit",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'vae_ddp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
