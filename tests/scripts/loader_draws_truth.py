"""Ground truth for the audit of augmentation drawn in DataLoader workers, measured with plain Lightning (no vae_ddp).

Usage: python tests/scripts/loader_draws_truth.py OUT_JSON CASE [...]

Each CASE is a datamodule of ``examples/audit_models.py`` whose dataset jitters every sample in
``__getitem__`` with ``torch.randn`` (``Jitter``): ``augment`` is ``Regression(augment=True,
num_workers=1)``, one worker per rank seeded as torch seeds it; ``rank_seeded`` is
``RankSeededWorkers()``, one worker per rank seeded by Lightning's ``pl_worker_init_function`` with
the rank. Each trains ``Plain`` as a user would, ``seed_everything(0)`` then ``Trainer(strategy="ddp",
devices=2)`` on gloo (Lightning's ``DistributedSampler``, global batch 16: 8 samples a rank), 2
optimizer steps, workers started with ``forkserver``. At each training batch every rank takes what
its worker drew, the batch's inputs minus the clean inputs of the samples they are (the nearest
clean row: the jitter's scale is 0.1, clean rows lie ~4 apart), and the ranks all-gather it.

Rank 0 writes ``{case: {"ranks", "per_rank" (samples a rank per batch), "distinct" (per batch: the
distinct draws among the ranks' ``ranks * per_rank``), "same_at_place" (per batch: the places j at
which rank 1's draw is rank 0's), "nearest" (the largest distance of a batch row to its clean row),
"second" (the smallest distance to the next clean row)}}``.
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
CASES = {"augment": lambda: audit_models.Regression(batch_size=8, augment=True, num_workers=1),
         "rank_seeded": lambda: audit_models.RankSeededWorkers(batch_size=8)}


class Draws(pl.Callback):
    """What each batch's samples were jittered by, on this rank: ``(batch, 8)`` rows a batch."""

    def __init__(self) -> None:
        self.noise, self.nearest, self.second = [], 0.0, float("inf")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        x = batch[0].double()
        clean = trainer.datamodule.train_set.x.double()
        dist_ = torch.cdist(x, clean)
        two = dist_.topk(2, dim=1, largest=False)
        self.nearest = max(self.nearest, float(two.values[:, 0].max()))
        self.second = min(self.second, float(two.values[:, 1].min()))
        self.noise.append(x - clean[two.indices[:, 0]])


def measure(case: str) -> dict:
    pl.seed_everything(0, verbose=False)
    dm, draws = CASES[case](), Draws()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[draws])
    trainer.fit(audit_models.Plain(), datamodule=dm)
    out = {"ranks": trainer.world_size, "per_rank": dm.batch_size, "distinct": [], "same_at_place": [],
           "nearest": max(trainer.strategy.all_gather(torch.tensor(draws.nearest)).tolist()),
           "second": min(trainer.strategy.all_gather(torch.tensor(draws.second)).tolist())}
    for noise in draws.noise:
        every = trainer.strategy.all_gather(noise)  # (ranks, per_rank, 8)
        rows = {tuple(round(v, 12) for v in row.tolist()) for rank in every for row in rank}
        out["distinct"].append(len(rows))
        out["same_at_place"].append(int((every[1] == every[0]).all(dim=1).sum()))
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
