"""The space an audit asks for before it starts against what its folder held at most: its runs' tensors,
all of them on disk when the audit drops them (``outputs.drop_tensors``), and its logs."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)


def _on_disk(folder: Path) -> int:
    """Bytes the files under ``folder`` take on the file system (their blocks)."""
    return sum(p.lstat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("model, args", [("Plain", {}), ("Wide", {"width": 20000})], ids=["465 parameters",
                                                                                           "200,001 parameters"])
def test_the_space_an_audit_asks_for_is_what_it_writes(tmp_path, monkeypatch, model, args):
    """The estimate the launch checks (``space_needed``) lies between 1x and 3x what the audit's folder held
    when it was fullest (``--steps 2``, no effect runs): it counts every run planned, also those trained only
    where their factor is exposed (``AuditRun.if_seen``), which these models are not. Before, every audit
    asked for 2 MiB beside nothing for its tensors: 2.1 MB for ``Plain``'s 0.3 MB, and as little for a model
    whose tensors take 130 MB."""
    import examples.audit_models as models
    import vae_ddp.audit.study as study
    import vae_ddp.harness.launch as launch
    from vae_ddp.audit.api import audit

    asked, held = [], []
    monkeypatch.setattr(launch, "space_needed", lambda spec, real=launch.space_needed: asked.append(real(spec))
                        or asked[-1])
    monkeypatch.setattr(study, "drop_tensors", lambda folder, real=study.drop_tensors: held.append(
        _on_disk(tmp_path / "out")) or real(folder))
    audit(getattr(models, model), models.Regression, model_args=args, data_args={"shuffle": False}, steps=2,
          effect_batches=0, out=tmp_path / "out")
    assert asked and held, (asked, held)
    ratio = sum(asked) / max(held)
    print(f"{model}: asked {sum(asked)}, held {max(held)}, {ratio:.2f}x")
    assert 1.0 <= ratio <= 3.0, f"asked for {sum(asked)} bytes, the folder held {max(held)} at most: {ratio:.2f}x"
