"""Ground truth for the audit of steps that write state, measured with plain Lightning and torch.distributed
(no vae_ddp).

Usage: python tests/scripts/stateful_truth.py OUT_JSON MODEL[:free] [...]

For each module of ``examples/audit_models.py`` named, as ``tests/scripts/whole_step_truth.py``
trains it (``seed_everything(0)``, float64, ``Regression``'s 64 samples in order, global batch 16,
one device, one device with the samples of each batch permuted, and ``Trainer(strategy="ddp",
devices=2)`` on gloo with each rank the r-th contiguous half of one device's global batch), 3
optimizer steps. ``MODEL:free`` trains it as a user's ``Trainer`` given neither ``max_epochs`` nor
``max_steps`` would, stopped by a callback (``trainer.should_stop``) after the 3 steps, instead of
``max_steps=3, max_epochs=2``.

Rank 0 writes ``{entry: {"max_epochs" (what ``self.trainer.max_epochs`` read in the module),
"lrs_single", "lrs_ddp" (each optimizer step's learning rates), "params" and "params_floor" (the
largest absolute difference of rank 0's parameters, and of the permuted run's, from one device's
after the 3 steps), "buffers" and "buffers_floor" (the same per buffer, integer buffers included:
``{name: value}``), "ranks_buffers" (per buffer, the largest difference between the two ranks'),
"grad_same_seed", "grad_reseeded" (the one-process gradient of the first global batch, float64:
the largest relative difference of a second call with the same seed from the first, and of a
fresh copy of the module with another seed from a fresh copy with the first; None for a step that needs a Trainer)}}``.
"""

import copy
import json
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from whole_step_truth import STEPS, Batches, Rates, audit_models  # noqa: E402


class Stop(pl.Callback):
    """Ends the fit after ``STEPS`` optimizer steps, as a user's callback would (``should_stop``)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= STEPS:
            trainer.should_stop = True


class Epochs(pl.Callback):
    """What ``self.trainer.max_epochs`` reads when the module configures its optimizers."""

    max_epochs = None

    def on_fit_start(self, trainer, pl_module) -> None:
        self.max_epochs = trainer.max_epochs


def fit(entry: str, devices: int, permute: bool = False):
    name, _, mode = entry.partition(":")
    pl.seed_everything(0, verbose=False)
    model = getattr(audit_models, name)()
    rates, epochs = Rates(), Epochs()
    limits = dict(callbacks=[rates, epochs, Stop()]) if mode == "free" else dict(
        callbacks=[rates, epochs], max_steps=STEPS, max_epochs=2)
    kw = dict(strategy="ddp", use_distributed_sampler=False) if devices > 1 else {}
    trainer = pl.Trainer(accelerator="cpu", devices=devices, precision="64-true", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         **limits, **kw)
    rank = trainer.global_rank if devices > 1 else 0
    trainer.fit(model, datamodule=Batches(rank, devices, permute))
    return model, rates, epochs, trainer


def split(model) -> tuple[dict, dict]:
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    return params, buffers


def largest(a: dict, b: dict) -> dict:
    return {k: float((a[k].double() - b[k].double()).abs().max()) for k in a}


def one_process(name: str) -> tuple[float, float]:
    """The first global batch's gradient, one process, float64: a second call with the same seed
    against the first, and a fresh copy with seed 1 against a fresh copy with seed 0."""
    pl.seed_everything(0, verbose=False)
    model = getattr(audit_models, name)().double()
    dm = audit_models.Regression(batch_size=16, shuffle=False)
    dm.setup("fit")
    batch = [t.double() for t in next(iter(dm.train_dataloader()))]

    def grad(m, seed):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        m.training_step(batch, 0).backward()
        return torch.cat([p.grad.reshape(-1) for p in m.parameters()])

    fresh = copy.deepcopy(model)
    first = grad(model, 0)
    again = grad(model, 0)
    a, b = grad(copy.deepcopy(fresh), 0), grad(copy.deepcopy(fresh), 1)
    rel = lambda x, y: float((x - y).norm() / y.norm())  # noqa: E731
    return rel(again, first), rel(b, a)


def main(out: str, entries: list[str]) -> None:
    one = {e: (fit(e, 1), fit(e, 1, permute=True)) for e in entries}
    result = {}
    for e in entries:
        model, rates, epochs, trainer = fit(e, 2)
        params, buffers = split(model)
        (single, one_rates, one_epochs, _), (permuted, _, _, _) = one[e]
        (p1, b1), (pp, bp) = split(single), split(permuted)
        ranks = {}
        for k, v in buffers.items():
            both = trainer.strategy.all_gather(v.double())  # (2, ...)
            ranks[k] = float((both[1] - both[0]).abs().max())
        try:
            same_seed, reseeded = one_process(e.partition(":")[0])
        except RuntimeError:  # a step that needs a Trainer (self.all_gather): not measured in one process
            same_seed = reseeded = None
        result[e] = {"max_epochs": epochs.max_epochs, "max_epochs_single": one_epochs.max_epochs,
                     "lrs_single": one_rates.lrs, "lrs_ddp": rates.lrs,
                     "params": max(largest(params, p1).values()), "params_floor": max(largest(pp, p1).values()),
                     "buffers": largest(buffers, b1), "buffers_floor": largest(bp, b1), "ranks_buffers": ranks,
                     "grad_same_seed": same_seed, "grad_reseeded": reseeded}
    if trainer.is_global_zero:
        Path(out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
