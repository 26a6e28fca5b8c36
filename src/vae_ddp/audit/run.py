"""Audit runs of one world size in one process tree: ``python -m vae_ddp.audit.run RUNS_JSON OUT_DIR``.

``RUNS_JSON`` is a list of [`AuditRun`][vae_ddp.audit.spec.AuditRun] with the same ``devices``;
they are trained one after the other in the same processes (Lightning reuses the process
group), which saves a launch per variant. Under ``strategy="ddp"`` Lightning's launcher
re-runs this command for the other ranks. Rank 0 writes ``OUT_DIR/<label>.pt`` (the final
parameters of each run) and ``OUT_DIR/run.json``: ``{label: {"findings": [...], "steps": int}}``,
the findings being what [`DDPAudit`][vae_ddp.audit.callback.DDPAudit] saw.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader

from vae_ddp.audit.callback import DDPAudit
from vae_ddp.audit.spec import AuditRun, import_class
from vae_ddp.fixes.batchnorm import GlobalSyncBatchNorm
from vae_ddp.fixes.randomness import GlobalBatchRandomness, current_stream
from vae_ddp.fixes.sampler import GlobalBatchDistributedSampler
from vae_ddp.utils import close_process_group, quiet
from vae_ddp.workers import make_fork_safe

__all__ = ["build", "main"]


class PermuteWithinBatch(Callback):
    """Permute the samples inside each training batch (the same loss, another summation order).

    Every tensor of the batch whose first dimension is the batch size is permuted in place
    with a permutation drawn from a private generator (seed, step). The random draws of the
    step made through the running [`GlobalBatchStream`][vae_ddp.fixes.randomness.GlobalBatchStream]
    (noise, dropout masks of [`GlobalBatchRandomness`][vae_ddp.fixes.randomness.GlobalBatchRandomness],
    which must come before this callback) are permuted alike, so each sample keeps its random
    numbers. The global generator is not touched.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        tensors = _tensors(batch)
        b = tensors[0].shape[0]
        g = torch.Generator().manual_seed(self.seed * 7919 + trainer.global_step)
        perm = torch.randperm(b, generator=g)
        for t in tensors:
            if t.dim() > 0 and t.shape[0] == b:
                t.copy_(t[perm.to(t.device)])
        stream = current_stream()
        if stream is not None:
            draw = type(stream).draw.__get__(stream)

            def permuted(fn, shape, dtype=None, device="cpu", batch_dim=0):
                out = draw(fn, shape, dtype=dtype, device=device, batch_dim=batch_dim)
                return out.index_select(batch_dim, perm.to(out.device)) if out.shape[batch_dim] == b else out

            stream.draw = permuted
        self._stream = stream

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if getattr(self, "_stream", None) is not None:
            self._stream.__dict__.pop("draw", None)
            self._stream = None


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        batch = list(batch.values())
    return [t for t in batch if isinstance(t, torch.Tensor)]


def build(run: AuditRun) -> tuple[LightningModule, pl.LightningDataModule, Trainer]:
    """Seed, build the user's module and datamodule (per-device batch size) and the Trainer with
    ``run.fixes`` on. Call in every rank (Lightning re-runs the command)."""
    pl.seed_everything(run.seed, verbose=False)
    model_cls = import_class(run.model["class_path"], run.model_file)
    data_cls = import_class(run.data["class_path"], run.data_file)
    model = model_cls(**run.model.get("init_args", {}))
    data_args = dict(run.data.get("init_args", {}), batch_size=run.global_batch_size // run.devices)
    dm = data_cls(**data_args)
    callbacks: list[Callback] = []
    extra: dict[str, Any] = {}
    if "noise" in run.fixes:  # dropout layers and a `noise` attribute, drawn for the global batch
        callbacks.append(GlobalBatchRandomness(run.seed))
    if run.permute:
        callbacks.append(PermuteWithinBatch(run.seed))
    if "batchnorm" in run.fixes and run.devices > 1:
        if run.accelerator == "gpu":
            extra["sync_batchnorm"] = True
        else:
            extra["plugins"] = [GlobalSyncBatchNorm()]
    callbacks.append(DDPAudit(warn=False))
    trainer = Trainer(
        accelerator=run.accelerator, devices=run.devices, strategy="ddp" if run.devices > 1 else "auto",
        max_steps=run.steps, max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        precision="64-true" if run.dtype == "float64" else "32-true",
        use_distributed_sampler="sampler" not in run.fixes, callbacks=callbacks, **extra)
    if "sampler" in run.fixes:
        _deal_global_batches(dm, run, trainer.global_rank)
    _fork_safe_workers(dm)
    return model, dm, trainer


#: What the audit's runs noticed about the user's loaders in this process (one line each).
NOTES: list[str] = []


def _fork_safe_workers(dm: pl.LightningDataModule) -> None:
    """Wrap the datamodule's ``train_dataloader`` so that its loaders start their workers with
    ``forkserver`` unless the user chose a start method (see [`vae_ddp.workers`][vae_ddp.workers]):
    a worker forked from a rank that runs threads can hang at start, and the audit must end."""
    original = dm.train_dataloader

    def train_dataloader():
        loaders = original()
        for dl in _loaders(loaders):
            note = make_fork_safe(dl, preload=("vae_ddp.audit.spec",))
            if note and note not in NOTES:
                NOTES.append(note)
        return loaders

    dm.train_dataloader = train_dataloader


def _loaders(loaders: Any) -> list[DataLoader]:
    if isinstance(loaders, DataLoader):
        return [loaders]
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    return [dl for dl in loaders if isinstance(dl, DataLoader)] if isinstance(loaders, (list, tuple)) else []


def _deal_global_batches(dm: pl.LightningDataModule, run: AuditRun, rank: int) -> None:
    """Replace the datamodule's training sampler by the single-device global batches, dealt to
    the ranks in contiguous chunks ([`GlobalBatchDistributedSampler`][vae_ddp.fixes.sampler.GlobalBatchDistributedSampler])."""
    original = dm.train_dataloader

    def train_dataloader() -> DataLoader:
        dl = original()
        sampler = GlobalBatchDistributedSampler(dl.dataset, run.global_batch_size, num_replicas=run.devices,
                                                rank=rank, seed=run.seed)
        return DataLoader(dl.dataset, batch_size=run.global_batch_size // run.devices, sampler=sampler,
                          collate_fn=dl.collate_fn, num_workers=dl.num_workers, pin_memory=dl.pin_memory,
                          worker_init_fn=dl.worker_init_fn, generator=dl.generator,
                          multiprocessing_context=dl.multiprocessing_context,
                          persistent_workers=dl.persistent_workers)

    dm.train_dataloader = train_dataloader


def main(argv: list[str]) -> int:
    runs, out = [AuditRun(**r) for r in json.loads(argv[0])], Path(argv[1])
    quiet()
    out.mkdir(parents=True, exist_ok=True)
    info = {}
    for run in runs:
        model, dm, trainer = build(run)
        trainer.fit(model, datamodule=dm)
        if trainer.is_global_zero:
            audit = next(c for c in trainer.callbacks if isinstance(c, DDPAudit))
            torch.save({n: p.detach().cpu() for n, p in model.named_parameters()}, out / f"{run.label}.pt")
            info[run.label] = {"findings": audit.state(), "steps": trainer.global_step, "notes": list(NOTES)}
    if info:
        (out / "run.json").write_text(json.dumps(info))
    close_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
