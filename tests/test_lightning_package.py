"""Either Lightning package: a module built on ``lightning.pytorch`` (``import lightning as L``) is audited with
``lightning.pytorch``'s Trainer, one on ``pytorch_lightning`` with its own (``vae_ddp.lightning_package``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = pytest.mark.timeout(300)

sys.path.insert(0, str(ROOT))  # examples.*


def test_both_packages_are_installed_at_one_version():
    """``make setup`` installs ``lightning`` beside ``pytorch_lightning``, the same code at the same version."""
    from importlib.metadata import version

    assert version("lightning") == version("pytorch-lightning")


def test_under_the_variable_pytorch_lightning_is_lightning_pytorch_module_by_module():
    """``VAE_DDP_LIGHTNING=lightning``: every ``pytorch_lightning[.X]`` (``lightning_fabric[.X]``) this package
    imports is the module object of ``lightning.pytorch[.X]`` itself, its own ``__spec__`` kept; without it the
    two packages' classes differ."""
    script = ("import vae_ddp, importlib\n"
              "import pytorch_lightning as pl, lightning.pytorch as L, lightning_fabric as lf, lightning.fabric as F\n"
              "from pytorch_lightning.strategies import DDPStrategy\n"
              "from lightning.pytorch.strategies import DDPStrategy as D\n"
              "from vae_ddp.audit.callback import DDPAudit\n"
              "print(pl is L, lf is F, DDPStrategy is D, issubclass(DDPAudit, L.Callback),"
              " importlib.import_module('pytorch_lightning.strategies').__spec__.name)\n")
    src = str(ROOT / "src")
    shown = {}
    for value in ("lightning", None):
        env = {k: v for k, v in os.environ.items() if k != "VAE_DDP_LIGHTNING"}
        env.update({"PYTHONPATH": src} if value is None else {"PYTHONPATH": src, "VAE_DDP_LIGHTNING": value})
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=240)
        assert done.returncode == 0, done.stderr[-2000:]
        shown[value] = done.stdout.split()
    assert shown["lightning"] == ["True", "True", "True", "True", "lightning.pytorch.strategies"], shown
    assert shown[None] == ["False", "False", "False", "False", "pytorch_lightning.strategies"], shown


def test_which_package_a_class_is_built_on():
    import pytorch_lightning as pl

    from examples import audit_models, lightning_models
    from vae_ddp.errors import UserError
    from vae_ddp.lightning_package import is_a, of, one_package

    assert of(lightning_models.Plain) == "lightning" and of(audit_models.Plain) == "pytorch_lightning"
    base = "pytorch_lightning.core.module.LightningModule"
    assert is_a(lightning_models.Plain, base) and is_a(audit_models.Plain, base)
    assert not is_a(lightning_models.Regression, base) and not is_a(pl.LightningModule(), base)
    assert one_package(lightning_models.Plain, lightning_models.Regression) == "lightning"
    with pytest.raises(UserError, match="--model Plain is built on lightning.pytorch and --data Regression on "
                                        "pytorch_lightning: a Trainer takes one package's classes"):
        one_package(lightning_models.Plain, audit_models.Regression)


@pytest.mark.timeout(600)
def test_a_module_built_on_lightning_pytorch_is_audited_with_its_own_trainer():
    """``import lightning as L`` as Lightning's documentation writes it: refused before ("is not a LightningModule
    subclass"), now audited, and clean (exit 0). Ground truth from Lightning itself: ``pytorch_lightning``'s
    Trainer refuses this module, so the runs trained it with ``lightning.pytorch``'s."""
    import pytorch_lightning as pl

    from examples import lightning_models
    from vae_ddp.testing import assert_ddp_matches_one_device

    with pytest.raises(TypeError, match="must be a `LightningModule`"):
        pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False).fit(lightning_models.Plain(),
                                                                              lightning_models.Regression())
    result = assert_ddp_matches_one_device(lightning_models.Plain, lightning_models.Regression, effect_batches=0)
    assert result.exit_code == 0 and result.within_floor
