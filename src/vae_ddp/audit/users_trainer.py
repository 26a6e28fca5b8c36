"""The user's ``Trainer`` arguments in one of the audit's runs: what each becomes there.

- ``sync_batchnorm=True`` is the user's BatchNorm fix: kept in each DDP run (on CPU as the package's
  [`GlobalSyncBatchNorm`][vae_ddp.fixes.batchnorm.GlobalSyncBatchNorm], the same global-batch statistics: torch's
  ``SyncBatchNorm`` refuses CPU tensors), unless the run has the audit's own BatchNorm fix, which replaces it
  (Lightning refuses ``sync_batchnorm=True`` beside a ``LayerSync`` plugin); nothing on one device;
- those that do not change the comparison (``TRAINER_OVERRIDDEN``: accelerator, devices, logger, checkpoints,
  progress bar, summary) are replaced by the audit's own, each whose value differs named in a note;
- the rest go to the run's ``Trainer`` as given (``use_distributed_sampler=False`` with the user's own sampler
  too), but where the audit's fix in the run sets the same argument (the sampler fix deals one device's global
  batches with ``use_distributed_sampler=False`` of its own).
"""

from __future__ import annotations

from typing import Any

from vae_ddp.audit.spec import TRAINER_OVERRIDDEN

__all__ = ["in_run", "layer_sync_plugins"]


def in_run(run: Any, parts: Any) -> tuple[Any, dict, list[str]]:
    """For ``run`` (an [`AuditRun`][vae_ddp.audit.spec.AuditRun]) and ``parts`` (the audit's fixes in it, a
    ``FixParts``): ``(parts with the user's sync_batchnorm where it applies, the user's other Trainer arguments
    but those the audit replaces, notes)``."""
    from vae_ddp.fixes import batchnorm

    user, notes = dict(run.trainer), []
    if user.pop("sync_batchnorm", False) and run.devices > 1 and batchnorm.FACTOR.key not in run.fixes:
        parts = parts.merge(batchnorm.sync_batchnorm_parts(run.accelerator))
        if run.accelerator != "gpu":
            notes.append("sync_batchnorm=True: on CPU the DDP runs use plugins=[GlobalSyncBatchNorm()] "
                         "(vae_ddp.fixes), the same global-batch statistics (torch's SyncBatchNorm refuses CPU "
                         "tensors)")
    ours = {"accelerator": run.accelerator, "devices": run.devices, "logger": False, "enable_checkpointing": False,
            "enable_progress_bar": False, "enable_model_summary": False}
    for key, what in TRAINER_OVERRIDDEN.items():
        if key in user and str(value := user.pop(key)) != str(ours[key]) and (key != "devices" or run.devices > 1):
            notes.append(f"trainer.{key}={value!r}: the audit's runs use {key}={ours[key]!r} ({what})")
    for key in parts.trainer:  # the audit's fix in this run sets it (use_distributed_sampler=False: the sampler fix)
        user.pop(key, None)
    return parts, user, notes


def layer_sync_plugins(given: dict) -> dict:
    """``given`` (the user's Trainer arguments) with ``plugins`` that are BatchNorm's ``LayerSync`` alone (this
    package's ``GlobalSyncBatchNorm``, the audit's advice on CPU, or Lightning's ``TorchSyncBatchNorm``: an
    instance, a class path or ``{"class_path": ...}``) taken as ``sync_batchnorm=True``, the same fix; other
    plugins stay (the audit refuses them: its fixes are plugins)."""
    plugins = given.get("plugins")
    items = plugins if isinstance(plugins, (list, tuple)) else [plugins]
    names = [p.get("class_path") if isinstance(p, dict) else p if isinstance(p, str) else type(p).__name__
             for p in items]
    if plugins is None or not items or not all(isinstance(n, str) and n.rpartition(".")[2] in
                                                ("GlobalSyncBatchNorm", "TorchSyncBatchNorm") for n in names):
        return given
    return {**{k: v for k, v in given.items() if k != "plugins"}, "sync_batchnorm": True}
