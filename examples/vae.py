"""The report's training script in its Lightning 2.x form, built on LightningCLI.

The report (Lightning 1.2.6) ran bolts' VAE script, whose `cli_main` calls
`pl.seed_everything(1234)` and reads its flags with `Trainer.add_argparse_args`, as it
wrote them:

```bash
python vae.py --dataset=cifar10 --batch_size=256 # single gpu training
python vae.py --dataset=cifar10 --batch_size=128 --gpus=2 --accelerator=ddp
python vae.py --dataset=cifar10 --batch_size=256 --gpus=2 --accelerator=dp
```

The first line names no `--gpus`: Lightning 1.2.6's `Trainer` defaults to `gpus=None`, which
trains on the CPU (it warns "GPU available but not used"), although the line's comment says
one GPU. `--accelerator` meant the distributed backend in Lightning 1.2; Lightning 1.5 moved it
to `--strategy`. This script's default seed is the report's, 1234.

Lightning 2.x equivalents (`LightningCLI` replaced `add_argparse_args`; DP is gone, see
the DataParallel page):

```bash
python examples/vae.py fit --trainer.accelerator gpu --trainer.devices 1 --data.batch_size 256 --data.data_dir DIR
python examples/vae.py fit --trainer.accelerator gpu --trainer.devices 2 --trainer.strategy ddp --data.batch_size 128 \
    --data.data_dir DIR
```

where DIR is an ImageFolder tree (the default data class; it has no default folder), and on a
CPU with gloo, on a CIFAR-10 subset in such a tree (`.github/scripts/cifar10-subset.sh DIR` builds
one from public CIFAR-10 images):

```bash
python examples/vae.py fit --trainer.accelerator cpu --trainer.devices 2 --trainer.strategy ddp \
    --data.batch_size 128 --data.data_dir DIR
```

Full CIFAR-10, the report's `--dataset=cifar10` (torchvision downloads it into DIR):
`--data vae_ddp.data.CIFAR10DataModule --data.data_dir DIR`.
"""

import re
import sys

from pytorch_lightning.cli import LightningCLI

from vae_ddp.data import ImageFolderDataModule  # noqa: F401  (default data class)
from vae_ddp.errors import input_error
from vae_ddp.model import VAE
from vae_ddp.utils import close_process_group


class ReportCLI(LightningCLI):
    def add_arguments_to_parser(self, parser):
        parser.set_defaults({
            "data": {"class_path": "vae_ddp.data.ImageFolderDataModule",
                     "init_args": {"batch_size": 256}},  # data_dir: --data.data_dir or $VAE_DDP_CIFAR_SUBSET
        })


def _in_flags(message: str) -> str:
    """The data module's message in this script's flags: ``data_dir`` -> ``--data.data_dir``."""
    message = message.replace("data='imagefolder'", "--data ImageFolderDataModule")
    return " ".join(re.sub(r"(?<![\w./-])data_dir(?![\w=/-])", "--data.data_dir", message).split())


def main(args=None):
    try:
        return ReportCLI(VAE, subclass_mode_data=True, seed_everything_default=1234, args=args,
                         save_config_kwargs={"overwrite": True})
    except Exception as err:  # bad input (jsonargparse wraps what the data module raises): one line, exit code 2
        bad = input_error(err)
        if bad is None:
            raise
        print(f"vae.py: error: {_in_flags(str(bad))}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
    close_process_group()  # Lightning leaves the group open after fit; gloo can abort at exit
