"""The heartbeat reaches the guard from the project's own launches only (``vae_ddp.heartbeat``):
installing vae-ddp changes no other ``Trainer`` (no ``pytorch_lightning.callbacks_factory`` entry point)."""

from __future__ import annotations

import tomllib

from helpers import ROOT


def test_the_package_registers_no_lightning_callbacks():
    """An entry point of that group adds its callbacks to every ``Trainer`` of the environment
    vae-ddp is installed in, the audit's users' own training included."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [g for g in project.get("entry-points", {}) if "callbacks_factory" in g], project["entry-points"]


def test_the_project_trainers_beat_under_a_guard_only(monkeypatch, tmp_path):
    """A study's and an audit's ``Trainer`` carry a ``Heartbeat`` in a process under a guard (its
    heartbeat folder set), none outside one."""
    from vae_ddp.audit.run import build
    from vae_ddp.audit.spec import AuditRun
    from vae_ddp.harness.configs import RunSpec
    from vae_ddp.harness.runner import build_trainer
    from vae_ddp.heartbeat import Heartbeat

    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))
    run = AuditRun(model={"class_path": "examples.audit_models.Plain"},
                   data={"class_path": "examples.audit_models.Regression"}, devices=1, global_batch_size=16, steps=1)
    spec = RunSpec(config="single", steps=1).validate()
    for guarded in (False, True):
        if guarded:
            monkeypatch.setenv("VAE_DDP_HEARTBEAT_DIR", str(tmp_path))
        else:
            monkeypatch.delenv("VAE_DDP_HEARTBEAT_DIR", raising=False)
        for trainer in (build_trainer(spec, 0), build(run)[2]):
            beats = [c for c in trainer.callbacks if isinstance(c, Heartbeat)]
            assert len(beats) >= 1 if guarded else not beats, (guarded, trainer.callbacks)


SECOND_FIT = """
import os, signal, sys
from pytorch_lightning import Callback, Trainer
sys.path.insert(0, {root!r})
from examples.audit_models import Plain, Regression
from vae_ddp.heartbeat import callbacks


class Ask(Callback):  # the watchdog's request in the middle of the second fit
    def on_train_batch_end(self, *args):
        os.kill(os.getpid(), signal.SIGUSR1)


for fit in range(2):
    trainer = Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks() + [Ask()] * fit)
    trainer.fit(Plain(), Regression(shuffle=False))
os.kill(os.getpid(), signal.SIGUSR1)  # and between two fits
print("alive", flush=True)
"""


def test_the_stack_dump_survives_a_second_fit(tmp_path):
    """A process under a guard that trains twice (an audit's rank trains run after run) dumps its stacks on
    SIGUSR1 in its second fit, and is not killed by one between fits. Before, Lightning's teardown of the
    first fit set SIGUSR1 back to its default (``_SignalConnector.teardown``): the watchdog's SIGUSR1 killed
    the rank ('rank 0 of run 'ddp-sampler' was killed by SIGUSR1'), and a stalled audit named it 'in an
    unknown frame'."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, VAE_DDP_HEARTBEAT_DIR=str(tmp_path), PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-c", SECOND_FIT.format(root=str(ROOT))], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0 and "alive" in proc.stdout, (proc.returncode, proc.stderr[-2000:])
    dumps = [d.read_text() for d in tmp_path.glob("stacks-*.txt")]
    assert len(dumps) == 1 and "on_train_batch_end" in dumps[0], [d[:800] for d in dumps]
