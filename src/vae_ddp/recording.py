"""Recording what a run does, the same way for every configuration.

[`GlobalBatchRecorder`][vae_ddp.recording.GlobalBatchRecorder] is a Lightning callback that records, per optimizer step,
the train ``recon_loss``, ``kl`` and ``loss`` **over the whole global batch** (under DDP
the per-rank means are weighted by their batch sizes and summed across ranks with
``trainer.strategy.reduce(..., reduce_op="sum")``, not rank 0's half), next to what
Lightning logged on rank 0 (``trainer.callback_metrics``), and validation metrics over
the whole validation set with fixed noise, computed on rank 0.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from pytorch_lightning import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader

__all__ = ["GlobalBatchRecorder", "evaluate"]

METRICS = ("recon_loss", "kl", "loss")


@torch.no_grad()
def evaluate(module: LightningModule, loader: DataLoader, seed: int = 1234,
             batch_stats: bool = False) -> dict[str, float]:
    """Mean ``recon_loss``, ``kl`` and ``loss`` of ``module`` over all of ``loader``, in eval
    mode (BatchNorm running statistics), with reparameterization noise from a private
    generator seeded with ``seed`` (the same noise for every configuration), weighted by
    batch size. Restores the module's training mode.

    With ``batch_stats`` BatchNorm normalises with each validation batch's own statistics,
    as in training, and its running statistics are restored afterwards: the difference to
    the default isolates what the running statistics do to the validation values."""
    was_training = module.training
    module.eval()
    saved = None
    if batch_stats:
        bns = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        saved = [(m, {k: v.clone() for k, v in m.named_buffers(recurse=False)}) for m in bns]
        for m in bns:
            m.train()
    g = torch.Generator(device=module.device)
    g.manual_seed(seed)
    totals, n = torch.zeros(3, dtype=torch.float64), 0
    for x, _ in loader:
        x = x.to(device=module.device, dtype=module.dtype)
        h = module.encoder(x)
        mu = module.fc_mu(h)
        eps = torch.randn(mu.shape, generator=g, dtype=mu.dtype, device=mu.device)
        _, logs = module.step(x, eps)
        totals += torch.tensor([float(logs[k]) for k in METRICS], dtype=torch.float64) * len(x)
        n += len(x)
    module.train(was_training)
    for m, bufs in saved or []:
        for k, v in bufs.items():
            getattr(m, k).copy_(v)
    return {k: float(v) / n for k, v in zip(METRICS, totals)}


class GlobalBatchRecorder(Callback):
    """Record global-batch train metrics each step and validation metrics every ``val_every``.

    The LightningModule must leave its last step's detached metrics and batch size in
    ``pl_module.last_logs`` (as [`VAE`][vae_ddp.model.VAE] does).

    Args:
        total_steps: the run's ``max_steps`` (for progress and the last validation).
        val_every: validate every this many optimizer steps and after the last; 0: never.
        label: name printed in progress lines.
        progress: print a progress line to stdout about every 10% of the steps.

    Raises:
        RuntimeError: a rank's loss is not finite (NaN or infinite): the message names the run
            (``label``), the rank and the step.

    Attributes (rank 0 only):
        records: one dict per optimizer step: ``step`` (1-based), the global-batch
            ``recon_loss``, ``kl``, ``loss``, ``global_batch_size``, ``time_s`` (seconds
            since the start of fit, at the end of the step, validation excluded), and
            ``logged_<metric>``: what ``self.log`` put in ``callback_metrics`` on rank 0;
            with ``record_indices``, ``indices``: the dataset indices of the step's global
            batch (rank 0's, then rank 1's, ...), which needs a dataset returning them.
        val_records: ``{"step", "recon_loss", "kl", "loss"}`` per validation, and the same
            with ``_batch_stats`` appended: BatchNorm with each validation batch's statistics.
    """

    def __init__(self, total_steps: int, val_every: int = 0, label: str = "", progress: bool = True,
                 record_indices: bool = False) -> None:
        self.total_steps, self.val_every, self.label, self.progress = total_steps, val_every, label, progress
        self.record_indices = record_indices
        self.records: list[dict[str, Any]] = []
        self.val_records: list[dict[str, float]] = []
        self._val_loader: DataLoader | None = None
        self._t0 = 0.0

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._t0 = time.perf_counter()
        dm = trainer.datamodule
        if self.val_every and trainer.is_global_zero and dm is not None:
            self._val_loader = DataLoader(dm.dataset_val, batch_size=256, shuffle=False)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        logs = pl_module.last_logs
        n = logs["batch_size"]
        if not bool(torch.isfinite(logs["loss"]).all()):  # before the collective: this rank names itself
            raise RuntimeError(f"non-finite loss ({float(logs['loss'])}) in run '{self.label}' on rank "
                               f"{trainer.global_rank} at step {trainer.global_step}: lower the learning rate "
                               "(--lr) or check the data")
        stats = torch.stack([logs[k] * n for k in METRICS] + [n]).double()
        stats = trainer.strategy.reduce(stats, reduce_op="sum")
        step = trainer.global_step
        indices = None
        if self.record_indices:  # batch[1] holds dataset indices; equal per-rank sizes (DistributedSampler pads)
            indices = trainer.strategy.all_gather(batch[1]).reshape(-1).tolist()
        if not trainer.is_global_zero:
            return
        rec: dict[str, Any] = {"step": step, "global_batch_size": int(stats[-1]),
                               "time_s": time.perf_counter() - self._t0}
        rec.update({k: float(stats[i] / stats[-1]) for i, k in enumerate(METRICS)})
        if indices is not None:
            rec["indices"] = indices
        for k in METRICS:
            v = trainer.callback_metrics.get(f"train_{k}")
            rec[f"logged_{k}"] = None if v is None else float(v)
        self.records.append(rec)
        if self._val_loader is not None and (step % self.val_every == 0 or step == self.total_steps):
            t = time.perf_counter()
            rec_val = {"step": step, **evaluate(pl_module, self._val_loader)}
            # synchronised BatchNorm would wait for the other ranks in training mode: skip it there
            if not any(type(m).__name__ == "GlobalBatchNorm" for m in pl_module.modules()):
                bs = evaluate(pl_module, self._val_loader, batch_stats=True)
                rec_val.update({f"{k}_batch_stats": v for k, v in bs.items()})
            self.val_records.append(rec_val)
            self._t0 += time.perf_counter() - t  # keep time_s a training-only clock
        every = max(1, self.total_steps // 10)
        if self.progress and (step % every == 0 or step == self.total_steps):
            rate = step / max(time.perf_counter() - self._t0, 1e-9)
            speed = f"{rate:.1f} steps/s" if rate >= 1 else f"{1 / rate:.1f} s/step"
            print(f"[{self.label}] step {step}/{self.total_steps}  loss {rec['loss']:.4f}  kl {rec['kl']:.4f}  "
                  f"recon {rec['recon_loss']:.4f}  ({speed})", flush=True)
            sys.stdout.flush()
