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
