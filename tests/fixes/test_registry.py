"""The factor registry: one object per factor drives exact(), fixes(), the Trainer of a run, the
ablation's and the benchmark's variants and the CLI switches; its checks tell which factors a
given Trainer/module/datamodule is exposed to."""

import ast
import dataclasses
from typing import Literal

import pytest

from vae_ddp.fixes import registry
from vae_ddp.fixes.factor import Audit, Switch
from vae_ddp.fixes.registry import Factor, FixParts
from vae_ddp.harness.configs import RunSpec
from helpers import ROOT, load_script

#: the files that enumerate the fixes: none of them may name a factor's switch
DERIVED = ["src/vae_ddp/cli.py", "src/vae_ddp/harness/runner.py", "src/vae_ddp/studies/ablation.py",
           "src/vae_ddp/audit/run.py", "benchmarks/step_time.py"]


def _step_time():
    return load_script("benchmarks/step_time.py", "step_time_bench")


def test_six_factors_each_with_a_page():
    keys = [f.key for f in registry.factors()]
    assert keys == ["noise", "batchnorm", "sampler", "reduction", "logging", "optimizer"]
    for f in registry.factors():
        assert (ROOT / "docs" / f.page).is_file(), f.page
        assert (f.field is None) == (f.fixed_by is not None)
        if f.field is not None:  # the switch is a RunSpec field with its Lightning default
            assert getattr(RunSpec(), f.field) == f.default and f.fixed in f.choices


def test_exact_and_fixes_follow_the_registry():
    spec = RunSpec(config="ddp").exact()
    assert spec.fixes() == ["noise=global", "sync_bn", "sampler=global", "sync_dist_logging"]
    assert RunSpec().fixes() == []


@dataclasses.dataclass
class JitterSpec(RunSpec):
    """RunSpec with the switch of a made-up seventh factor.

    Attributes:
        jitter: augmentation jitter across ranks (``default`` or ``global``).
    """

    jitter: Literal["default", "global"] = "default"


class _Marker:
    pass


@pytest.fixture
def seventh_factor():
    marker = _Marker()

    def watch(seen):  # what DDPAudit checks at the start of a real fit
        return [registry.Finding("jitter", f"{seen.trainer.world_size} ranks jitter apart", "jitter the global batch")]

    f = registry.register(Factor(
        key="jitter", name="augmentation jitter", page="factors/jitter.md", changes="a callback",
        check=lambda t, m, d: None,
        switch=Switch("jitter", default="default", fixed="global", choices=("global",),
                      parts=lambda spec, seed: FixParts(callbacks=[marker])),
        audit=Audit(parts=lambda run: FixParts(callbacks=[marker]), watch={"train_start": watch},
                    clean="no jitter seen",
                    before=lambda model, dm, batches, n: [registry.Finding("jitter", f"{n} chunks", "chunk")])))
    yield f, marker
    registry.unregister("jitter")


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")  # the one-process checks call training_step
def test_a_new_factor_needs_only_its_registry_entry_and_its_field(seventh_factor):
    """Registered once (plus its typed RunSpec field), a factor shows up in exact(), fixes(), the
    Trainer's callbacks, the ablation's and the benchmark's variants and the CLI switches."""
    from vae_ddp.cli import build_parser
    from vae_ddp.studies.ablation import variants
    from vae_ddp.harness.runner import fix_parts

    factor, marker = seventh_factor
    spec = JitterSpec(config="ddp").exact()
    assert spec.jitter == "global" and "jitter=global" in spec.fixes()
    assert marker in fix_parts(spec, 0).callbacks and marker not in fix_parts(JitterSpec(), 0).callbacks
    assert variants()["jitter fix off"] == {"jitter": "default"}
    assert variants()["Lightning defaults (no fix)"]["jitter"] == "default"
    bench = _step_time().variants()
    assert bench["ddp + jitter=global"] == {"config": "ddp", "jitter": "global"}
    assert bench["ddp + all fixes"]["jitter"] == "global"
    cfg = build_parser(JitterSpec).parse_args(["compare", "--jitter", "global"])
    assert cfg.compare.jitter == "global"
    # the audit: its ablation runs every fix it has but one, its runs build what the factor declares
    from vae_ddp.audit.spec import AuditRun

    assert registry.audit_fixable() == ("noise", "batchnorm", "sampler", "jitter")
    run = AuditRun(model={"class_path": "m.M"}, data={"class_path": "d.D"}, global_batch_size=8,
                   fixes=list(registry.audit_fixable()))
    assert marker in registry.audit_parts(run).callbacks
    assert marker not in registry.audit_parts(dataclasses.replace(run, fixes=["noise"])).callbacks
    # DDPAudit runs the factor's own watch, at its hook, and reports it under the factor's name and page
    from types import SimpleNamespace

    import torch

    from vae_ddp.audit import DDPAudit
    from vae_ddp.audit.verdict import _clean

    class Module(torch.nn.Linear):
        device = torch.device("cpu")

    audit = DDPAudit(warn=False)
    trainer = SimpleNamespace(world_size=2, is_global_zero=True, callbacks=[], train_dataloader=None,
                              val_dataloaders=None)
    audit.on_train_start(trainer, Module(2, 2))
    found = [f for f in audit.findings if f.factor == "jitter"]
    assert [f.evidence for f in found] == ["2 ranks jitter apart"] and found[0].page == "factors/jitter.md"
    assert found[0].message().startswith("DDPAudit [augmentation jitter]: ")
    assert _clean("jitter") == "no jitter seen"  # the audit table's row when nothing is seen
    # the audit's one-process checks, before any training, run the factor's own
    from examples.audit_models import Plain, Regression
    from vae_ddp.audit.static import static_findings

    dm = Regression(batch_size=16)
    dm.setup("fit")
    batches = [next(iter(dm.train_dataloader()))]
    found, notes = static_findings(Plain(), dm, batches, 2)
    assert [f.evidence for f in found] == ["2 chunks"] and found[0].page == "factors/jitter.md" and not notes


SEVENTH = '''"""A made-up seventh factor: a module of vae_ddp.fixes that declares its FACTOR, nothing else."""

from vae_ddp.fixes.factor import Factor

FACTOR = Factor(position=7, key="jitter", name="Augmentation jitter", page="factors/jitter.md",
                changes="a callback", check=lambda trainer, module, datamodule: None)
'''

SHOW = """
import json, sys
sys.path.insert(0, sys.argv[1])
import site_hooks
from vae_ddp.fixes import registry
print(json.dumps({"keys": [f.key for f in registry.factors()], "nav": site_hooks.factor_nav(),
                  "api": site_hooks.fix_modules_markdown()}))
"""


def test_a_seventh_factor_module_is_in_the_registry_the_nav_and_the_api_page(tmp_path):
    """A copy of the package with one more fix module, ``fixes/jitter.py``, and no other edit: the
    registry finds its factor (after the six), the site's nav lists its page under its name, and
    the API page renders the module (what tools/site_hooks.py writes into mkdocs' config and page)."""
    import json
    import shutil
    import subprocess
    import sys

    shutil.copytree(ROOT / "src" / "vae_ddp", tmp_path / "vae_ddp", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "vae_ddp" / "fixes" / "jitter.py").write_text(SEVENTH)
    out = subprocess.run([sys.executable, "-c", SHOW, str(ROOT / "tools")], capture_output=True, text=True,
                         timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["keys"] == ["noise", "batchnorm", "sampler", "reduction", "logging", "optimizer", "jitter"]
    assert {"Not measured at the report's scale": [{"Augmentation jitter": "factors/jitter.md"}]} in got["nav"]
    assert "::: vae_ddp.fixes.jitter\n" in got["api"]
    assert got["api"].index("vae_ddp.fixes.optimizer") < got["api"].index("vae_ddp.fixes.jitter")


def test_the_derived_places_name_no_factor():
    """What a fix changes is written in the registry only: the CLI, the runner, the ablation and
    the benchmark enumerate the registry and name no switch."""
    fields = {f.field for f in registry.switches()}
    for path in DERIVED:
        tree = ast.parse((ROOT / path).read_text())
        docstrings = {id(n.value) for n in ast.walk(tree)
                      if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        for node in ast.walk(tree):
            named = (node.attr if isinstance(node, ast.Attribute) else node.arg if isinstance(node, ast.keyword)
                     else node.value if isinstance(node, ast.Constant) and id(node) not in docstrings else None)
            assert named not in fields, f"{path}:{getattr(node, 'lineno', '?')} names the switch {named!r}"


#: modules outside the fix modules that still name a factor key in code, each with why; the list
#: may only shrink (the test fails when one of them no longer names a key: remove it here). All
#: are the VAE study's own (studies/), which the audit and the fixes never import (test_layers.py).
NAMED_OUTSIDE = {
    "src/vae_ddp/studies/equivalence.py": "`optimizer`: the run's optimizer (adam, sgd), not the factor",
    "src/vae_ddp/studies/long_horizon.py": "`noise`: the VAE's noise mode of a run (a JSON field)",
    "src/vae_ddp/studies/report_scale/__init__.py": "`logging`, `reduction`: the JSON fields of the study's "
                                                    "logged-value and mean-reduction measurements",
    "src/vae_ddp/studies/report_scale/render.py": "`logging`, `reduction`: the study's JSON fields its tables show",
    "src/vae_ddp/studies/report_scale/variants.py": "the report-scale study's variants each switch one factor of "
                                                    "the VAE",
    "src/vae_ddp/studies/verdict.py": "the site's verdict words the VAE's factors by their measured rows",
    "src/vae_ddp/studies/answer.py": "the site's answer cites the Lightning or PyTorch documentation of each of the "
                                     "VAE's measured factors",
}


def _declares_factor(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "FACTOR" for t in n.targets)
               for n in tree.body)


def _attribute_names(tree: ast.AST) -> set[int]:
    """The ids of the string constants that name an attribute, not a factor: the name given to
    ``getattr``, ``hasattr`` or ``setattr``, and the key of ``X.__dict__.get(NAME)`` or
    ``vars(X).get(NAME)`` (an instance attribute looked up without the class's: the module's own
    ``noise`` that the random-stream fix and the floor's permutation stand in for)."""
    found = set()
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call) or not n.args:
            continue
        if getattr(n.func, "id", None) in ("getattr", "hasattr", "setattr") and len(n.args) > 1:
            found.add(id(n.args[1]))
        elif isinstance(n.func, ast.Attribute) and n.func.attr == "get":
            owner = n.func.value
            if (isinstance(owner, ast.Attribute) and owner.attr == "__dict__") or (
                    isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "vars"):
                found.add(id(n.args[0]))
    return found


def test_attribute_names_are_told_from_factor_keys():
    tree = ast.parse("getattr(m, 'noise')\nm.__dict__.get('noise')\nvars(m).get('noise', 1)\n"
                     "d.get('noise')\nx = {'noise': 1}\n")
    named = {n.lineno for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value == "noise"
             and id(n) not in _attribute_names(tree)}
    assert named == {4, 5}


def test_only_a_factors_own_module_names_it():
    """A glob over src/: a factor key written as a string in code (not a docstring, not an
    attribute name: ``_attribute_names``) appears only in the fix module that declares the factor's
    FACTOR, or in a module listed above with the reason."""
    keys = {f.key for f in registry.factors()}
    naming = {}
    for path in sorted((ROOT / "src").rglob("*.py")):
        tree = ast.parse(path.read_text())
        if _declares_factor(tree):
            continue
        skip = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        skip |= _attribute_names(tree)
        found = sorted({n.value for n in ast.walk(tree)
                        if isinstance(n, ast.Constant) and id(n) not in skip and n.value in keys})
        if found:
            naming[str(path.relative_to(ROOT))] = found
    assert set(naming) - set(NAMED_OUTSIDE) == set(), f"these modules name a factor key: {naming}"
    assert set(NAMED_OUTSIDE) - set(naming) == set(), \
        "these name no factor key any more: remove them from NAMED_OUTSIDE"
    declared = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "src").rglob("*.py")
                      if _declares_factor(ast.parse(p.read_text())))
    assert len(declared) == len(registry.factors()), declared  # one module per factor


def _exposures(fixes: bool, devices: int = 2):
    import pytorch_lightning as pl

    from vae_ddp.data import DigitsDataModule
    from vae_ddp.harness.runner import build_model, fix_parts

    spec = RunSpec(config="ddp" if devices > 1 else "single", devices=devices, global_batch_size=32).validate()
    spec = spec.exact() if fixes else spec
    parts = fix_parts(spec, 0)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                         logger=False, callbacks=parts.callbacks, plugins=parts.plugins or None, **parts.trainer)
    dm = DigitsDataModule(batch_size=spec.per_device_batch_size, **parts.datamodule)
    return registry.exposures(trainer, build_model(spec, 0), dm)


def test_exposure_checks_on_real_objects():
    default = _exposures(fixes=False)
    # digits: 1438 training samples, 719 per rank, per-device batch 16: the last batch has 15
    assert set(default) == {"noise", "sampler", "reduction", "logging", "optimizer"} | (
        {"batchnorm"} if "batchnorm" in default else set())
    assert "15 of 16 samples" in default["reduction"]
    assert _exposures(fixes=True) == {}
    assert _exposures(fixes=False, devices=1) == {}


def test_batchnorm_check_sees_the_layers_and_the_plugin():
    import pytorch_lightning as pl
    from torch import nn

    from vae_ddp.fixes import GlobalSyncBatchNorm

    bn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    check = registry.get("batchnorm").check
    plain = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    synced = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, plugins=[GlobalSyncBatchNorm()])
    assert check(plain, bn, None).startswith("1 BatchNorm layers")
    assert check(synced, bn, None) is None
    assert check(plain, nn.Sequential(nn.Conv2d(3, 4, 3)), None) is None


def test_the_audit_links_each_page_where_a_reader_finds_it(monkeypatch):
    """Without a published site the link is the page's title (its heading on the site) and its path on the
    site, not a file of a checkout; with the package's ``Documentation`` URL it is the page's MkDocs
    directory URL under it."""
    from vae_ddp.fixes import factor

    monkeypatch.setattr(factor, "docs_url", lambda: "")
    pages = {f.page for f in registry.factors()} | set(factor.PAGE_TITLES)
    for page in pages:
        text = (ROOT / "docs" / page).read_text()
        if text.startswith("---\n"):  # the page's metadata (YAML, whose comments also start with "# ")
            text = text.split("\n---\n", 1)[1]
        heading = next(line[2:].strip() for line in text.splitlines() if line.startswith("# "))
        assert factor.page_title(page) == heading, (page, heading)
        assert factor.page_url(page).startswith(f'the "{heading}" page of the vae-ddp documentation (')
    noise = factor.page_url("factors/noise.md")
    assert "docs/" not in noise and noise.endswith("(factors/noise/)"), noise
    monkeypatch.setattr(factor, "docs_url", lambda: "https://example.org/vae-ddp/")
    assert factor.page_url("factors/noise.md") == "https://example.org/vae-ddp/factors/noise/"
    assert factor.page_url("index.md") == "https://example.org/vae-ddp/"
    assert factor.page_url("questions/index.md") == "https://example.org/vae-ddp/questions/"
    assert factor.Finding("noise", "seen", "the fix").message().endswith("(see https://example.org/vae-ddp/factors/noise/)")


def test_a_watch_at_an_unknown_hook_is_refused_with_the_factor_named():
    """A factor whose audit watches a hook DDPAudit never calls would never be checked: declaring
    it fails, naming the factor and the hooks there are."""
    from vae_ddp.fixes.factor import HOOKS

    with pytest.raises(ValueError, match=r"factor 'jitter': watch hooks \['on_fit_start'\] are not among"):
        Factor(key="jitter", name="augmentation jitter", page="factors/jitter.md", changes="a callback",
               check=lambda t, m, d: None, audit=Audit(watch={"on_fit_start": lambda seen: []}))
    Factor(key="jitter", name="augmentation jitter", page="factors/jitter.md", changes="a callback",
           check=lambda t, m, d: None, audit=Audit(watch={HOOKS[0]: lambda seen: []}))
