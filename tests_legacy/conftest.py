"""Legacy suite: runs in .venv-legacy (Lightning 1.9.5 + lightning-bolts 0.7.0), see `make legacy-test`.

Not under tests/, so the main suite (Lightning 2.x, no bolts) never collects it.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LEGACY = ROOT / "examples" / "legacy"
DATA = Path(os.environ.get("VAE_DDP_CIFAR_DIR", ROOT.parent / "shared" / "data" / "cifar10-jpg-subset"))
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"

if str(LEGACY) not in sys.path:
    sys.path.insert(0, str(LEGACY))
warnings.filterwarnings("ignore", message=".*under review.*")


def pytest_configure(config):
    import pytorch_lightning as pl

    if not pl.__version__.startswith("1."):
        raise pytest.UsageError(f"tests_legacy needs Lightning 1.x (found {pl.__version__}): run `make legacy-test`")
    if not (DATA / "train").is_dir():
        raise pytest.UsageError(f"the CIFAR-10 subset is missing at {DATA} (set VAE_DDP_CIFAR_DIR)")


def run(args, timeout=900, python=None, env=None):
    """Run ``python args...`` from the repository root; returns the CompletedProcess."""
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env or {}))
    e.pop("PL_GLOBAL_SEED", None)
    return subprocess.run([str(python or sys.executable), *map(str, args)], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="session")
def data_dir() -> str:
    return str(DATA)
