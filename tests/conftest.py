import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CIFAR_SUBSET = Path(os.environ.get("VAE_DDP_CIFAR_SUBSET", ROOT.parent / "shared" / "data" / "cifar10-jpg-subset"))
FULL = os.environ.get("VAE_DDP_FULL") == "1"


@pytest.fixture(scope="session")
def cifar_dir() -> Path:
    if not (CIFAR_SUBSET / "train").is_dir():
        pytest.fail(f"the shared CIFAR-10 subset is missing at {CIFAR_SUBSET} (see ../shared/data/README.md)")
    return CIFAR_SUBSET


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


def _hook():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_generate_hook", ROOT / "docs" / "hooks" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def needs_cifar(entry: dict) -> bool:
    """Whether a registry entry reads the CIFAR-10 subset (``--data imagefolder`` or a path to
    it); the others train on the bundled digits and run without any data folder."""
    args = entry["full_args"] if FULL else entry["args"]
    return any(a == "imagefolder" or "cifar10-jpg-subset" in a for a in args)


@pytest.fixture(scope="session")
def generated(request):
    """``generated(name) -> dict``: run the docs registry entry ``name`` (docs/examples.yml) the
    way the site build does, cached by the same hash, and return the JSON it wrote. The site
    and the tests thus read one execution of each example and study. Only entries that read
    the CIFAR-10 subset need it (through the ``cifar_dir`` fixture)."""
    import json

    hook = _hook()
    entries = {e["name"]: e for e in hook.load_registry(ROOT)}

    def get(name: str, filename: str | None = None) -> dict:
        if needs_cifar(entries[name]):
            request.getfixturevalue("cifar_dir")
        hook.run_entry(ROOT, entries[name])
        out = ROOT / hook.GENERATED / name
        assert (out / "stdout.txt").read_text().strip(), f"{name} printed nothing"
        return json.loads((out / (filename or f"{name}.json")).read_text())

    return get
