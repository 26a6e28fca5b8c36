"""The architecture gallery (examples/gallery.py, examples/audit_gallery.py, docs/gallery.md).

The full gallery needs timm, transformers and segmentation_models_pytorch and many minutes
(`make gallery`, committed under docs/results/audit-gallery); here: the committed results are
what the script renders and the diagnoses it expects, and the reduced gallery (the DCGAN as
written and with its fix: torchvision and the project only) gets its expected diagnosis.
"""

from __future__ import annotations

import json

import pytest
from helpers import ROOT

RESULTS = ROOT / "docs" / "results" / "audit-gallery"


@pytest.fixture(scope="module")
def gallery():
    from examples import audit_gallery

    return audit_gallery


def test_the_page_shows_what_the_committed_gallery_renders(gallery):
    result = json.loads((RESULTS / "audit_gallery.json").read_text())
    assert (RESULTS / "tables.md").read_text() == gallery.render(result) + "\n"
    assert (RESULTS / "command.md").read_text() == gallery.command_md(result, "docs/results/audit-gallery")
    assert [a["name"] for a in result["audits"]] == list(gallery.GALLERY) == list(gallery.EXPECTED)
    assert len([name for name in gallery.GALLERY if ", " not in name]) >= 8  # architectures; "X, the fix": a variant
    assert gallery.check(result) == []  # every committed diagnosis is the expected one
    page = (ROOT / "docs" / "gallery.md").read_text()
    assert '--8<-- "docs/results/audit-gallery/tables.md"' in page
    # the one command the page shows is the one the gallery (and the reduced test) runs
    assert " ".join(["vae-ddp", *gallery.arguments("DCGAN")]) in page.replace("\\\n    ", "")


def test_cells_and_verdicts_follow_the_audit_rules(gallery):
    """The words of the table, from made-up findings."""
    f = dict(factor="batchnorm", exposed=True, automatic_fix=True, contribution=0.2, bites=True, fix="")
    assert gallery.cell(f) == "bites"
    assert gallery.cell(dict(f, bites=False)) == "no effect"
    assert gallery.cell(dict(f, bites=None)) == "not separable"
    assert gallery.cell(dict(f, contribution=None, bites=None)) == "exposed"
    assert gallery.cell(dict(f, automatic_fix=False, contribution=None, bites=None)) == "your code"
    assert gallery.cell(dict(f, exposed=False)) == "-"
    a = dict(exit_code=1, deterministic=False, unexplained=False)
    assert gallery.verdict(a) == "1 not judged"
    assert gallery.verdict(dict(a, deterministic=True)) == "1 your code"
    assert gallery.verdict(dict(a, deterministic=True, unexplained=True)) == "1 unexplained"
    assert gallery.verdict(dict(a, exit_code=0)) == "0 passed"
    assert gallery.verdict(dict(a, exit_code=3)) == "3 run failed"
    assert gallery.fixes({"fix": "Trainer(plugins=[vae_ddp.fixes.GlobalSyncBatchNorm()]); vae_ddp.fixes.X"}) == [
        "GlobalSyncBatchNorm", "X"]


@pytest.mark.timeout(600)
def test_the_reduced_gallery_gets_its_diagnosis(gallery, tmp_path):
    """A DCGAN (BatchNorm, two optimizers, `z = torch.randn(...)` in training_step): the audit
    names the noise vector as a draw its fix does not serve (exit 1, not "unexplained"); drawn
    with `global_batch_draw`, DDP with the fixes computes one device's step (exit 0)."""
    audits = [gallery.audit_one(name, tmp_path / str(i), in_process=True) for i, name in enumerate(
        ["DCGAN", "DCGAN, z for the global batch"])]
    result = {"steps": 3, "audits": audits}
    assert gallery.check(result) == [], json.dumps([{k: a[k] for k in ("name", "exit_code", "error", "notes")}
                                                   for a in audits])[-3000:]
    noise = next(f for f in audits[0]["findings"] if f["factor"] == "noise")
    assert "does not serve" in noise["evidence"] and "global_batch_draw" in noise["fix"]
    assert not audits[0]["unexplained"] and audits[1]["within_floor"]
    assert all(a["seconds"] > 0 for a in audits) and "| DCGAN |" in gallery.render(result)


def test_autograd_all_gather_over_gloo_returns_a_wrong_gradient_when_it_is_not_contiguous(generated):
    """What the page says of the SimCLR row whose keys are built by a transpose (torch 2.14.1):
    the gradient of the rows comes back exact when the gradient reaching all_gather is
    contiguous, and wrong when it is not (pytorch/pytorch#192920: gloo's scatter)."""
    r = generated("gloo_all_gather")
    assert r["contiguous"] == 0.0 and r["transposed"] > 0.1, r  # relative to the exact gradient's largest entry
