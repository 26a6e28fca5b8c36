"""The recipe: make Lightning DDP compute what one device computes.

Four changes to an ordinary LightningModule + Trainer, one per factor (see each factor's
page). With them, `vae-ddp equivalence` finds DDP on 2 and 4 processes equal to one
device up to rounding. Copy the marked lines into your own script:

    python examples/recipe.py --devices 2 --out out/recipe

Lightning starts the other ranks by re-running this command.
"""

import argparse
import json
from pathlib import Path

import pytorch_lightning as pl

from vae_ddp.data import DigitsDataModule
from vae_ddp.fixes import GlobalBatchNoise, GlooSyncBatchNorm
from vae_ddp.model import VAE
from vae_ddp.utils import quiet


def main(argv=None):
    p = argparse.ArgumentParser(description="DDP that matches one device")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("out/recipe"))
    args = p.parse_args(argv)
    quiet()
    seed = 1234
    pl.seed_everything(seed)
    # --8<-- [start:fixes]
    model = VAE(enc_type="small", latent_dim=32,
                sync_dist_logging=True)                          # 5. logging: self.log(..., sync_dist=True)
    datamodule = DigitsDataModule(
        batch_size=args.global_batch_size // args.devices,       # per-device batch size = global / world size
        sampler="global", sampler_seed=seed)                     # 3+4. GlobalBatchDistributedSampler
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy="ddp", max_steps=args.steps,
        use_distributed_sampler=False,                           # 3. keep our sampler
        callbacks=[GlobalBatchNoise(seed)],                      # 1. noise of the global batch, sliced by rank
        plugins=[GlooSyncBatchNorm()],                           # 2. BatchNorm over the global batch (CPU/gloo);
        #                                                             on GPUs: sync_batchnorm=True instead
        logger=False, enable_checkpointing=False, enable_progress_bar=False)
    # --8<-- [end:fixes]
    trainer.fit(model, datamodule=datamodule)
    if trainer.is_global_zero:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "recipe.json").write_text(json.dumps(metrics, indent=1))
        print("| logged at the last step (global batch) | value |\n|---|---|")
        for k, v in sorted(metrics.items()):
            print(f"| {k} | {v:.5f} |")


if __name__ == "__main__":
    main()
