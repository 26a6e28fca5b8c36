"""Ground truth for the whole-step audit tests, measured with plain Lightning and torch.distributed (no vae_ddp).

Usage: python tests/scripts/whole_step_truth.py OUT_JSON MODEL[@DATAMODULE] [...]

For each module of ``examples/audit_models.py`` named, from ``seed_everything(0)``, float64,
``Regression``'s 64 samples in order, global batch 16, 3 optimizer steps (``max_epochs=2``):

- ``single``: one device, batches of 16;
- ``permuted``: one device, the samples inside each batch of 16 permuted (what rounding alone does);
- ``ddp``: ``Trainer(strategy="ddp", devices=2)`` on gloo, ``use_distributed_sampler=False``,
  each rank a per-device loader of batches of 8 (as long as the user's own ``batch_size=8``
  loader) that deals rank r the r-th contiguous half of one device's global batch: the same
  global batches as ``single``.

``MODEL@DATAMODULE`` trains on that datamodule of ``examples/audit_models.py`` instead, as its user
would: batch 16 on one device, 8 per rank under Lightning's defaults (its own sampler injection),
and records whether the two ranks' first training batches were the same (``"same_first_batch"``).

Rank 0 writes ``{entry: {"lrs_single", "lrs_ddp" (each optimizer step's learning rates),
"ddp" (the largest absolute difference of rank 0's parameters and buffers from one device's after
the 3 steps), "ranks" (the largest between the two ranks' parameters and buffers), "floor" (the same for
``permuted``), "worst" (the name that differs most in "ddp")}}``.
"""

import json
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples import audit_models  # noqa: E402

N, GLOBAL, STEPS = 64, 16, 3


class Rates(pl.Callback):
    """Each optimizer step's learning rates; under DDP, whether the ranks' first batches are the same."""

    def __init__(self) -> None:
        self.lrs, self.same_first_batch = [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.same_first_batch is None and trainer.world_size > 1:
            x = trainer.strategy.all_gather(batch[0])  # (2, b, ...)
            self.same_first_batch = bool(torch.equal(x[0], x[1]))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.lrs.append([g["lr"] for g in optimizer.param_groups])


class Batches(audit_models.Regression):
    """Regression's samples in order, in global batches of 16: one device's, a rank's half, or permuted."""

    def __init__(self, rank: int = 0, world: int = 1, permute: bool = False) -> None:
        super().__init__(batch_size=GLOBAL // world, n=N, shuffle=False)
        self.rank, self.world, self.permute = rank, world, permute

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(7)
        batches = []
        for start in range(0, N, GLOBAL):
            b = list(range(start, start + GLOBAL))
            if self.permute:
                b = [b[i] for i in torch.randperm(GLOBAL, generator=g)]
            per = GLOBAL // self.world
            batches.append(b[self.rank * per:(self.rank + 1) * per])
        # as many batches as the user's own loader of per-device batches would hold (N / (GLOBAL / world))
        batches = (batches * self.world)[:N * self.world // GLOBAL]
        return DataLoader(self.train_set, batch_sampler=batches)


def fit(entry: str, devices: int, permute: bool = False) -> tuple[dict, Rates, pl.Trainer]:
    model_name, _, data = entry.partition("@")
    pl.seed_everything(0, verbose=False)
    model = getattr(audit_models, model_name)()
    rates = Rates()
    kw = dict(strategy="ddp", use_distributed_sampler=bool(data)) if devices > 1 else {}
    trainer = pl.Trainer(accelerator="cpu", devices=devices, max_steps=STEPS, max_epochs=2, precision="64-true",
                         logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[rates], **kw)
    rank = trainer.global_rank if devices > 1 else 0
    dm = (getattr(audit_models, data)(batch_size=GLOBAL // devices, n=N, shuffle=False) if data and not permute
          else Batches(rank, devices, permute))
    trainer.fit(model, datamodule=dm)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}
    return state, rates, trainer


def largest(a: dict, b: dict) -> tuple[float, str]:
    return max((float((a[k] - b[k]).abs().max()), k) for k in a)


def main(out: str, models: list[str]) -> None:
    one = {m: (fit(m, 1), fit(m, 1, permute=True)) for m in models}
    result = {}
    for m in models:
        state, rates, trainer = fit(m, 2)
        params = torch.cat([t.reshape(-1) for t in state.values()])
        both = trainer.strategy.all_gather(params)  # (2, P)
        (single, one_rates, _), (permuted, _, _) = one[m]
        ddp, worst = largest(state, single)
        result[m] = {"lrs_single": one_rates.lrs, "lrs_ddp": rates.lrs, "ddp": ddp, "worst": worst,
                     "ranks": float((both[1] - both[0]).abs().max()), "floor": largest(permuted, single)[0],
                     "same_first_batch": rates.same_first_batch}
    if trainer.is_global_zero:
        Path(out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
