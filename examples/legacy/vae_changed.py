"""The report's script (``vae.py`` beside this file) with the change for DDP, in Lightning 1.x names.

The report ran Lightning 1.2.6; the names used here (``Trainer(sync_batchnorm=True,
replace_sampler_ddp=False)``, ``self.log(..., sync_dist=True)``, ``LightningModule.setup``,
``self.global_rank``, ``self.trainer.world_size``) are the same in 1.2.6 and in 1.9.5, where this
script runs (``make legacy``); Lightning 2.x renamed ``replace_sampler_ddp`` to
``use_distributed_sampler``. Everything else is ``vae.py``'s ``cli_main`` as bolts wrote it.

Two promises; ``--same`` picks one:

- ``--same distribution``: DDP trains the same model *in distribution* as one device: each rank draws
  its own reparameterization noise (a generator seeded ``1234 + self.global_rank`` in ``setup``, after
  Lightning's ``seed_everything``, instead of ``q.rsample()`` on the global generator, which every rank
  seeds alike), BatchNorm normalises over the global batch (``Trainer(sync_batchnorm=True)``) and the
  logged values are the global batch's (``sync_dist=True``). Lightning's ``DistributedSampler`` stays:
  other samples and other draws than one device's, from the same distribution. Cost: BatchNorm's
  all-reduce in every forward pass, one all-reduce per logged value per step.
- ``--same step``: DDP's step is one device's step, to rounding: the noise is one draw for the global
  batch (a generator seeded ``1234`` alike on every rank and on one device), each rank takes its rows,
  and ``Trainer(replace_sampler_ddp=False)`` with a sampler that deals each global batch of one
  device's shuffled order to the ranks in contiguous chunks (torch and Lightning have none; this uses
  ``vae_ddp.fixes.sampler.GlobalBatchDistributedSampler``, a ``DistributedSampler`` for any map-style
  dataset); BatchNorm and logging as above. Cost: every rank draws the whole global batch's noise
  (``B x 256`` numbers a step) and the sampler is not Lightning's.

On a CPU (gloo), where torch's ``SyncBatchNorm`` refuses CPU tensors, the script puts the package's CPU
equivalent in its place (``Trainer(plugins=[vae_ddp.fixes.batchnorm.GlobalSyncBatchNorm()])``, a
``LayerSync`` plugin that normalises over the global batch with gloo's all-reduce) and says so.

    python examples/legacy/vae_changed.py --same step --data_dir DIR \\
        --accelerator cpu --devices 2 --strategy ddp --batch_size 8 --max_steps 3 --num_workers 0
"""

import sys
from argparse import ArgumentParser

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from imagefolder_cifar10 import DataDirError, ImageFolderCIFAR10DataModule
from vae import ReportVAE

NOISE_SEED = 1234


# --8<-- [start:module]
class ChangedVAE(ReportVAE):
    """The report's VAE with its noise drawn for ``--same`` (``distribution`` or ``step``) and its
    values logged over the global batch."""

    def __init__(self, *args, same: str = "distribution", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.same = same
        self.noise = None

    def setup(self, stage=None) -> None:  # after seed_everything, in every rank
        seed = NOISE_SEED + (self.global_rank if self.same == "distribution" else 0)
        self.noise = torch.Generator(device=self.device).manual_seed(seed)

    def sample(self, mu, log_var):
        std = torch.exp(log_var / 2)
        p = torch.distributions.Normal(torch.zeros_like(mu), torch.ones_like(std))
        q = torch.distributions.Normal(mu, std)
        if not self.training or self.noise is None:
            return p, q, q.rsample()  # validation: as the report's script
        if self.same == "distribution":  # was: z = q.rsample()
            eps = torch.randn(mu.shape, generator=self.noise, device=mu.device, dtype=mu.dtype)
        else:  # the global batch's draw; this rank's rows (equal per-rank batches: the sampler drops the rest)
            b, world, rank = mu.shape[0], self.trainer.world_size, self.global_rank
            eps = torch.randn((world * b, *mu.shape[1:]), generator=self.noise, device=mu.device,
                              dtype=mu.dtype)[rank * b:(rank + 1) * b]
        return p, q, mu + std * eps

    def training_step(self, batch, batch_idx):
        loss, logs = self.step(batch, batch_idx)
        self.log_dict({f"train_{k}": v for k, v in logs.items()}, on_step=True, on_epoch=False,
                      sync_dist=True)  # was: without sync_dist (rank 0's half batch)
        return loss
# --8<-- [end:module]


# --8<-- [start:data]
class GlobalBatchData(ImageFolderCIFAR10DataModule):
    """``--same step``: every rank's batch k is its chunk of one device's batch k."""

    def train_dataloader(self):
        from vae_ddp.fixes.sampler import GlobalBatchDistributedSampler

        world = self.trainer.world_size
        sampler = GlobalBatchDistributedSampler(self.dataset_train, global_batch_size=self.batch_size * world)
        return DataLoader(self.dataset_train, batch_size=self.batch_size, sampler=sampler,
                          num_workers=self.num_workers, pin_memory=self.pin_memory)
# --8<-- [end:data]


def cli_main(args=None):
    pl.seed_everything()

    parser = ArgumentParser()
    parser.add_argument("--dataset", default="cifar10", type=str, choices=["cifar10"])
    parser.add_argument("--kl_estimator", default="mc", type=str, choices=["mc", "analytic"])
    parser.add_argument("--same", default="distribution", type=str, choices=["distribution", "step"])
    script_args, _ = parser.parse_known_args(args)

    dm_cls = GlobalBatchData if script_args.same == "step" else ImageFolderCIFAR10DataModule

    parser = ChangedVAE.add_model_specific_args(parser)
    parser = pl.Trainer.add_argparse_args(parser)
    args = parser.parse_args(args)

    try:
        dm = dm_cls.from_argparse_args(args)
    except DataDirError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2)
    args.input_height = dm.dims[-1]

    model = ChangedVAE(**vars(args))

    # --8<-- [start:trainer]
    changes = dict(sync_batchnorm=True, replace_sampler_ddp=script_args.same != "step")
    if args.accelerator == "cpu":  # torch's SyncBatchNorm refuses CPU tensors: the CPU equivalent instead
        from vae_ddp.fixes.batchnorm import GlobalSyncBatchNorm

        changes.update(sync_batchnorm=False, plugins=[GlobalSyncBatchNorm()])
        print("vae_changed.py: on CPU, vae_ddp's GlobalSyncBatchNorm in place of sync_batchnorm=True", file=sys.stderr)
    trainer = pl.Trainer.from_argparse_args(args, **changes)
    # --8<-- [end:trainer]
    trainer.fit(model, datamodule=dm)
    return dm, model, trainer


if __name__ == "__main__":
    dm, model, trainer = cli_main()
