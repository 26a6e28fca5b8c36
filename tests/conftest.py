import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CIFAR_SUBSET = ROOT.parent / "shared" / "data" / "cifar10-jpg-subset"
FULL = os.environ.get("VAE_DDP_FULL") == "1"


@pytest.fixture(scope="session")
def cifar_dir() -> Path:
    if not (CIFAR_SUBSET / "train").is_dir():
        pytest.fail(f"the shared CIFAR-10 subset is missing at {CIFAR_SUBSET} (see ../shared/data/README.md)")
    return CIFAR_SUBSET


@pytest.fixture(scope="session")
def cifar_batch(cifar_dir):
    """32 real CIFAR-10 subset images, (32, 3, 32, 32) float32 in [0, 1]."""
    import torch

    from vae_ddp.data import ImageFolderDataModule

    dm = ImageFolderDataModule(str(cifar_dir), batch_size=32, max_samples=500)
    dm.setup()
    x, _ = next(iter(dm.val_dataloader()))
    assert x.shape == (32, 3, 32, 32) and x.dtype == torch.float32
    return x


def run_cli(*args: str, timeout: float = 600):
    import subprocess

    return subprocess.run([sys.executable, "-m", "vae_ddp.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def pytest_collection_modifyitems(config, items):
    """Full-size studies run only with VAE_DDP_FULL=1 (`make test-full`); CI runs the reduced ones."""
    if FULL:
        return
    skip = pytest.mark.skip(reason="full-size study: run with VAE_DDP_FULL=1 (make test-full)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
