"""The report's script (Lightning issue #6789), run on Lightning 1.9.5 + lightning-bolts 0.7.0.

The report trained lightning-bolts' CIFAR-10 VAE; its script opens as bolts'
``pl_bolts/models/autoencoders/basic_vae/basic_vae_module.py`` at commit 261a098 (the file of
lightning-bolts 0.3.1 to 0.3.3), with ``pl.seed_everything(1234)`` where bolts' ``cli_main``
calls ``pl.seed_everything()`` without a seed. This script keeps that file's ``cli_main`` as
bolts wrote it: ``pl.seed_everything()`` (with a seed or without one, every DDP rank seeds
its generator alike), ``VAE.add_model_specific_args``, ``Trainer.add_argparse_args``,
``CIFAR10DataModule.from_argparse_args``, ``Trainer.from_argparse_args``, ``fit``. The report
(Lightning 1.2.6) ran it as it wrote these lines:

    python vae.py --dataset=cifar10 --batch_size=256 # single gpu training
    python vae.py --dataset=cifar10 --batch_size=128 --gpus=2 --accelerator=ddp
    python vae.py --dataset=cifar10 --batch_size=256 --gpus=2 --accelerator=dp

The model is lightning-bolts' own ``VAE`` class, imported from the installed package, not
a copy. Everything below follows bolts' ``cli_main``; these are the only changes, each forced:

1. Command line, Lightning 1.2 -> 1.9.5: ``--accelerator dp|ddp`` meant the distributed
   backend in 1.2; in 1.9.5 ``accelerator`` is the device type and ``Trainer(accelerator=
   "ddp")`` raises ``ValueError: You selected an invalid accelerator name``. The backend
   is now ``--strategy dp|ddp``. ``--gpus N`` is still accepted by 1.9.5 (deprecated) on a
   CUDA machine; on CPU use ``--accelerator cpu --devices N`` (``--strategy dp`` needs CUDA
   devices in 1.x). The script code itself is unchanged by this.
2. ``args.input_height = dm.size()[-1]`` -> ``dm.dims[-1]``: ``LightningDataModule.size()``
   no longer exists in 1.9.5 (bolts 0.7.0 made the same change).
3. ``if args.max_steps == -1: args.max_steps = None`` removed: 1.9.5 rejects
   ``Trainer(max_steps=None)`` (``TypeError`` in ``TrainingEpochLoop``: ``None < -1``; -1 now
   means "no limit"). bolts 0.7.0 still has the line, so its own ``cli_main`` fails on
   1.9.5 unless ``--max_steps`` is given.
4. The KL term: bolts 0.7.0's ``VAE.step`` computes the analytic ``kl_divergence(q, p)``;
   the bolts of the report's era (0.2/0.3) computed the one-sample Monte Carlo estimate
   ``q.log_prob(z) - p.log_prob(z)``. :class:`ReportVAE` overrides ``step`` to restore it
   (``--kl_estimator mc``, the default); ``--kl_estimator analytic`` runs bolts 0.7.0's own
   ``step`` unchanged. Forced by bolts (0.7.0 is the only release that installs beside
   Lightning 1.9.5), not by Lightning.
5. Data: bolts' ``CIFAR10DataModule`` downloads the CIFAR-10 archive; on machines without it
   the script uses ``ImageFolderCIFAR10DataModule`` (``imagefolder_cifar10.py`` beside this
   file): bolts' own ``CIFAR10DataModule`` class with only its ``dataset_cls`` swapped for an
   ImageFolder reader, so the split rules are bolts' code. ``--dataset cifar10`` is kept;
   ``--data_dir`` must point at ``<dir>/train/<class>/*.jpg`` (bad paths: one line, exit 2).

On a CPU (gloo), with DIR a CIFAR-10 ImageFolder tree (``.github/scripts/cifar10-subset.sh DIR``
builds one from public CIFAR-10 images):

    python examples/legacy/vae.py --data_dir DIR \\
        --accelerator cpu --devices 1 --batch_size 16 --max_steps 3 --num_workers 0
    python examples/legacy/vae.py --data_dir DIR \\
        --accelerator cpu --devices 2 --strategy ddp --batch_size 8 --max_steps 3 --num_workers 0
"""

import sys
from argparse import ArgumentParser

import pytorch_lightning as pl
import torch  # noqa: F401  (bolts' module imports it; the script keeps bolts' imports)
from pl_bolts.models.autoencoders import VAE
from torch.nn import functional as F  # noqa: N812

from imagefolder_cifar10 import DataDirError, ImageFolderCIFAR10DataModule


class ReportVAE(VAE):
    """bolts 0.7.0's ``VAE`` with the report-era loss (change 4 above).

    ``step(batch, batch_idx)`` with ``batch = (x, y)``, ``x: (B, 3, 32, 32)``, returns
    ``(loss, {"recon_loss", "kl", "loss"})``, scalars: ``recon_loss`` is the element-mean
    MSE, ``kl = kl_coeff * mean(log q(z|x) - log p(z))`` over ``(B, latent_dim)`` at the
    single sample ``z = q.rsample()``.
    """

    def __init__(self, *args, kl_estimator: str = "mc", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kl_estimator = kl_estimator

    def step(self, batch, batch_idx):
        if self.kl_estimator == "analytic":
            return super().step(batch, batch_idx)
        x, y = batch
        z, x_hat, p, q = self._run_step(x)

        recon_loss = F.mse_loss(x_hat, x, reduction="mean")

        log_qz = q.log_prob(z)
        log_pz = p.log_prob(z)

        kl = log_qz - log_pz
        kl = kl.mean()
        kl *= self.kl_coeff

        loss = kl + recon_loss

        logs = {
            "recon_loss": recon_loss,
            "kl": kl,
            "loss": loss,
        }
        return loss, logs


def cli_main(args=None):
    pl.seed_everything()

    parser = ArgumentParser()
    parser.add_argument("--dataset", default="cifar10", type=str, choices=["cifar10"])
    parser.add_argument("--kl_estimator", default="mc", type=str, choices=["mc", "analytic"])  # change 4
    script_args, _ = parser.parse_known_args(args)

    dm_cls = ImageFolderCIFAR10DataModule  # change 5 (was pl_bolts' CIFAR10DataModule)

    parser = VAE.add_model_specific_args(parser)
    parser = pl.Trainer.add_argparse_args(parser)
    args = parser.parse_args(args)

    try:
        dm = dm_cls.from_argparse_args(args)
    except DataDirError as err:  # change 5: one line, exit 2
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2)
    args.input_height = dm.dims[-1]  # change 2 (was dm.size()[-1])

    # change 3: `if args.max_steps == -1: args.max_steps = None` removed

    model = ReportVAE(**vars(args))

    trainer = pl.Trainer.from_argparse_args(args)
    trainer.fit(model, datamodule=dm)
    return dm, model, trainer


if __name__ == "__main__":
    dm, model, trainer = cli_main()
