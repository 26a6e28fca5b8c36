"""The report's script (examples/legacy/vae.py) on Lightning 1.9.5: runs single and as DDP
(2 gloo processes) for a few steps on the shared CIFAR-10 subset, and the changes it lists
are forced by 1.9.5."""

import re

import pytest
import pytorch_lightning as pl
import torch

from conftest import run

SCRIPT = "examples/legacy/vae.py"
COMMON = ["--num_workers", "0", "--max_steps", "2", "--limit_val_batches", "1", "--enable_progress_bar", "false"]


def _checkpoint(root):
    ckpts = sorted(root.glob("lightning_logs/version_0/checkpoints/*.ckpt"))
    assert len(ckpts) == 1, ckpts
    return ckpts[0], torch.load(ckpts[0], map_location="cpu", weights_only=False)


def test_single_device(tmp_path, data_dir):
    proc = run([SCRIPT, "--data_dir", data_dir, "--accelerator", "cpu", "--devices", "1", "--batch_size", "4",
                *COMMON, "--default_root_dir", tmp_path])
    assert proc.returncode == 0, proc.stderr[-3000:]
    path, ckpt = _checkpoint(tmp_path)
    assert path.name == "epoch=0-step=2.ckpt"
    assert ckpt["global_step"] == 2
    assert ckpt["pytorch-lightning_version"] == "1.9.5"
    hp = ckpt["hyper_parameters"]
    assert (hp["batch_size"], hp["input_height"], hp["kl_coeff"], hp["latent_dim"]) == (4, 32, 0.1, 256)
    assert sum(t.numel() for k, t in ckpt["state_dict"].items() if "running" not in k and "num_batches" not in k) \
        == 20_057_088
    assert re.search(r"Global seed set to \d+", proc.stdout + proc.stderr)  # the report's seed_everything()


def test_ddp_two_gloo_processes(tmp_path, data_dir):
    proc = run([SCRIPT, "--data_dir", data_dir, "--accelerator", "cpu", "--devices", "2", "--strategy", "ddp",
                "--batch_size", "2", *COMMON, "--default_root_dir", tmp_path])
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "distributed_backend=gloo" in log
    assert "Starting with 2 processes" in log
    _, ckpt = _checkpoint(tmp_path)
    assert ckpt["global_step"] == 2
    assert ckpt["hyper_parameters"]["batch_size"] == 2


def test_report_command_line_fails_on_195(tmp_path, data_dir):
    """Change 1: the report's `--accelerator ddp` is rejected by 1.9.5."""
    proc = run([SCRIPT, "--data_dir", data_dir, "--accelerator", "ddp", "--devices", "2", "--batch_size", "2",
                *COMMON, "--default_root_dir", tmp_path])
    assert proc.returncode != 0
    assert "invalid accelerator name: `accelerator='ddp'`" in proc.stderr


def test_bad_data_dir_is_one_line(tmp_path):
    proc = run([SCRIPT, "--data_dir", tmp_path / "nope", "--accelerator", "cpu", "--devices", "1",
                *COMMON, "--default_root_dir", tmp_path])
    assert proc.returncode == 2
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "--data_dir" in errors[0] and "train/" in errors[0]
    assert "Traceback" not in proc.stderr


def test_forced_changes_are_forced():
    """Changes 2 and 3, checked on the installed 1.9.5 rather than from memory."""
    assert pl.__version__ == "1.9.5"
    assert not hasattr(pl.LightningDataModule, "size")  # dm.size() is gone
    assert hasattr(pl.Trainer, "add_argparse_args")  # the report's argparse flow still works
    with pytest.raises(TypeError, match="'<' not supported"):
        pl.Trainer(max_steps=None, logger=False)  # `args.max_steps = None` is rejected


def test_dp_on_cpu_silently_becomes_ddp():
    """1.9.5 accepts strategy='dp' with accelerator='cpu' but runs DDP instead (with a warning)."""
    from pytorch_lightning.strategies import DDPStrategy

    with pytest.warns(UserWarning, match="'dp' is not supported on CPUs"):
        t = pl.Trainer(accelerator="cpu", devices=2, strategy="dp", logger=False)
    assert type(t.strategy) is DDPStrategy


def test_datamodule_follows_bolts_split_rules(data_dir):
    from imagefolder_cifar10 import ImageFolderCIFAR10DataModule
    from pl_bolts.datamodules import CIFAR10DataModule

    dm = ImageFolderCIFAR10DataModule(data_dir, batch_size=16, num_workers=0)
    assert isinstance(dm, CIFAR10DataModule) and dm.dims == (3, 32, 32)
    dm.setup("fit")
    assert (len(dm.dataset_train), len(dm.dataset_val)) == (8000, 2000)
    assert dm.num_samples == 8000
    # bolts' own split: random_split(seed 42) over the training pool
    expected = torch.randperm(10000, generator=torch.Generator().manual_seed(42)).tolist()
    assert dm.dataset_train.indices == expected[:8000]
    x, y = dm.dataset_train[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and 0 <= float(x.min()) <= float(x.max()) <= 1
    loader = dm.train_dataloader()
    assert len(loader) == 500 and type(loader.sampler).__name__ == "RandomSampler"
