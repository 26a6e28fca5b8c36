"""Ground truth for the audit of augmentation drawn in DataLoader workers, measured with plain Lightning (no vae_ddp).

Usage: python tests/scripts/loader_draws_truth.py OUT_JSON CASE [...]

Each CASE is a datamodule of ``examples/audit_models.py`` whose dataset jitters every sample in
``__getitem__`` with ``torch.randn`` (``Jitter``): ``augment`` is ``Regression(augment=True,
num_workers=1)``, one worker per rank seeded as torch seeds it; ``rank_seeded`` is
``RankSeededWorkers()``, one worker per rank seeded by Lightning's ``pl_worker_init_function`` with
the rank. Each trains ``Plain`` as a user would, ``seed_everything(0)`` then ``Trainer(strategy="ddp",
devices=2)`` on gloo (Lightning's ``DistributedSampler``, global batch 16: 8 samples a rank), 2
optimizer steps, workers started with ``forkserver``. At each training batch every rank takes what
its worker drew, the batch's inputs minus the clean inputs of its samples (their indices from the
loader's ``DistributedSampler``), and the ranks all-gather it.

Rank 0 writes ``{case: {"ranks", "per_rank" (samples a rank per batch), "distinct" (per batch: the
distinct draws among the ranks' ``ranks * per_rank``, two alike within 1e-5), "same_at_place" (per
batch: the places j at which rank 1's draw is rank 0's), "matched" (every batch row's nearest clean
row is its sample's: the indices are right)}}``.
"""

import json
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples import audit_models  # noqa: E402

STEPS = 2
TOL = 1e-5  # two draws alike: within float32's rounding of the jittered input; the jitter's scale is 0.1
CASES = {"augment": lambda: audit_models.Regression(batch_size=8, augment=True, num_workers=1),
         "rank_seeded": lambda: audit_models.RankSeededWorkers(batch_size=8)}


def distinct(rows: torch.Tensor) -> int:
    """Rows not within ``TOL`` of an earlier row: the batch is float32, and ``x_i + jitter`` minus
    ``x_i`` keeps the jitter only to float32's rounding of the sum (~1e-7)."""
    return sum(not any(torch.allclose(rows[i], rows[j], rtol=0, atol=TOL) for j in range(i)) for i in range(len(rows)))


class Draws(pl.Callback):
    """What each batch's samples were jittered by, on this rank: ``(batch, 8)`` rows a batch, each the
    batch's row minus the clean row of its sample (the sample's index from the loader's
    ``DistributedSampler``, in the order it deals them; ``matched``: every row's nearest clean row is
    that sample's)."""

    def __init__(self) -> None:
        self.noise, self.matched = [], True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        x = batch[0].double()
        clean = trainer.datamodule.train_set.x.double()
        order = list(trainer.train_dataloader.sampler)
        idx = torch.tensor(order[batch_idx * len(x):(batch_idx + 1) * len(x)])
        self.matched &= bool((torch.cdist(x, clean).argmin(dim=1) == idx).all())
        self.noise.append(x - clean[idx])


def measure(case: str) -> dict:
    pl.seed_everything(0, verbose=False)
    dm, draws = CASES[case](), Draws()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[draws])
    trainer.fit(audit_models.Plain(), datamodule=dm)
    matched = trainer.strategy.all_gather(torch.tensor(draws.matched))
    out = {"ranks": trainer.world_size, "per_rank": dm.batch_size, "distinct": [], "same_at_place": [],
           "matched": bool(matched.all())}
    for noise in draws.noise:
        every = trainer.strategy.all_gather(noise)  # (ranks, per_rank, 8)
        out["distinct"].append(distinct(every.reshape(-1, every.shape[-1])))
        out["same_at_place"].append(int(((every[1] - every[0]).abs() <= TOL).all(dim=1).sum()))
    return out, trainer


def main(out: str, cases: list[str]) -> None:
    mp.set_start_method("forkserver", force=True)  # the DataLoader's workers (the project's rule)
    result, trainer = {}, None
    for case in cases:
        result[case], trainer = measure(case)
    if trainer.is_global_zero:
        Path(out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
