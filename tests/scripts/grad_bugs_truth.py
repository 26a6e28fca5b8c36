"""Ground truth for the audit of gradients no automatic fix closes, measured with plain Lightning and
torch.distributed (no vae_ddp).

Usage: python tests/scripts/grad_bugs_truth.py OUT_JSON MODEL [...]

For each module of ``tests/scripts/grad_bugs.py`` named, from ``seed_everything(0)``, float64,
``Rows``' 64 samples in order, global batch 16, 3 training batches (``max_epochs=1``):

- one device, batches of 16; and the same with the samples of each batch permuted (the floor);
- ``Trainer(strategy="ddp", devices=2)`` on gloo, ``use_distributed_sampler=False``, rank r taking
  the r-th contiguous half of one device's global batch: the same global batches.

Rank 0 writes ``{model: {"optimizers": [{"parameters", "scale", "cosine", "relative"}, ...]`` (per
optimizer step of the first batch, where both runs start from the same weights: rank 0's gradient
of the optimizer's own parameters when it steps, against one device's: ``s = <a, b> / <b, b>``, the
cosine, ``||a - b|| / ||b||``), ``"ranks_apart"`` (the largest ``||g^1 - g^0|| / ||g^0||`` of those
steps), ``"ranks_mean"`` (the largest relative difference of the ranks' mean gradient from one
device's), ``"params"`` and ``"params_floor"`` (the largest absolute difference of rank 0's
parameters, and of the permuted run's, from one device's after the 3 batches), ``"ranks_params"``
(the same between the two ranks' parameters)}}``.
"""

import json
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

import grad_bugs  # noqa: E402

N, GLOBAL, BATCHES = 64, 16, 3


class Halves(grad_bugs.Rows):
    """Rows' samples in order, in global batches of 16: one device's, a rank's half, or permuted."""

    def __init__(self, rank: int = 0, world: int = 1, permute: bool = False) -> None:
        super().__init__(batch_size=GLOBAL // world, n=N)
        self.rank, self.world, self.permute = rank, world, permute

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(5)
        per = GLOBAL // self.world
        batches = []
        for start in range(0, GLOBAL * BATCHES, GLOBAL):
            b = list(range(start, start + GLOBAL))
            if self.permute:
                b = [b[i] for i in torch.randperm(GLOBAL, generator=g)]
            batches.append(b[self.rank * per:(self.rank + 1) * per])
        return DataLoader(self.train_set, batch_sampler=batches)


class Grads(pl.Callback):
    """Each optimizer step's gradient of the optimizer's own parameters (names, flat float64), and
    under DDP every rank's."""

    def __init__(self) -> None:
        self.steps = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        own = {id(p) for group in optimizer.param_groups for p in group["params"]}
        named = [(n, p) for n, p in pl_module.named_parameters() if id(p) in own and p.grad is not None]
        flat = torch.cat([p.grad.detach().reshape(-1).double() for _, p in named])
        ranks = trainer.strategy.all_gather(flat) if trainer.world_size > 1 else flat[None]  # (world, P)
        self.steps.append((trainer.global_step, [n for n, _ in named], flat.clone(), ranks.clone()))


def fit(name: str, devices: int, permute: bool = False):
    pl.seed_everything(0, verbose=False)
    model = getattr(grad_bugs, name)()
    grads = Grads()
    kw = dict(strategy="ddp", use_distributed_sampler=False) if devices > 1 else {}
    trainer = pl.Trainer(accelerator="cpu", devices=devices, max_epochs=1, precision="64-true", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[grads], **kw)
    rank = trainer.global_rank if devices > 1 else 0
    trainer.fit(model, datamodule=Halves(rank, devices, permute))
    return model, grads, trainer


def compare(a, b) -> dict:
    s = float(a @ b / (b @ b))
    return {"scale": s, "cosine": float(a @ b / (a.norm() * b.norm())), "relative": float((a - b).norm() / b.norm())}


def main(out: str, names: list[str]) -> None:
    one = {m: (fit(m, 1), fit(m, 1, permute=True)) for m in names}
    result = {}
    for m in names:
        model, grads, trainer = fit(m, 2)
        (single, single_grads, _), (permuted, _, _) = one[m]
        per_batch = len(grads.steps) // BATCHES
        optimizers, apart, mean = [], [], []
        for (_, names_ddp, a, ranks), (_, names_one, b, _) in zip(grads.steps[:per_batch],
                                                                  single_grads.steps[:per_batch]):
            optimizers.append(dict(compare(a, b), parameters=names_one))
            apart.append(float((ranks[1] - ranks[0]).norm() / ranks[0].norm()))
            mean.append(float((ranks.mean(0) - b).norm() / b.norm()))
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        both = trainer.strategy.all_gather(params)  # (2, P)
        largest = lambda x, y: max(float((p - q).abs().max())  # noqa: E731
                                   for p, q in zip(x.parameters(), y.parameters()))
        result[m] = {"optimizers": optimizers, "ranks_apart": max(apart), "ranks_mean": max(mean),
                     "params": largest(model, single), "params_floor": largest(permuted, single),
                     "ranks_params": float((both[1] - both[0]).abs().max())}
    if trainer.is_global_zero:
        Path(out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
