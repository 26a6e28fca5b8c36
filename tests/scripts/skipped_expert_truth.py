"""Plain Lightning (no vae_ddp): examples.audit_models.SkippedExpert under 2-rank DDP (gloo), 3 steps.

Usage (from the repository root): python tests/scripts/skipped_expert_truth.py STRATEGY
Measured: ddp_find_unused_parameters_true finishes the 3 steps (19 s, imports included); ddp hangs
(no step finished in 10 minutes; it ignored timeout's SIGTERM and was killed). Not run by the tests:
a hang is the outcome it shows.
"""
import sys
import time
from pathlib import Path

import pytorch_lightning as pl
import torch.distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.audit_models import SkippedExpert, Regression
pl.seed_everything(0, verbose=False)
t = time.time()
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=sys.argv[1], max_steps=3, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(SkippedExpert(), Regression(batch_size=8))
print(f"rank {trainer.global_rank} finished 3 steps in {time.time() - t:.1f} s", flush=True)
torch.distributed.destroy_process_group()  # Lightning leaves the group open; gloo can abort at exit
