"""The audit's plan (``vae_ddp.audit.plan``): which runs every audit trains, and which only where the
deciding DDP runs see a factor exposed (``AuditRun.if_seen``, decided in ``vae_ddp.audit.run``). No process
is started; ``test_study.py`` checks ``audit.json``'s ``runs`` of real audits."""

from __future__ import annotations

from vae_ddp.audit import effects
from vae_ddp.audit.plan import KEYED, plan
from vae_ddp.audit.spec import DECIDING, DRAWS_LEFT, HAS_BUFFERS, LEFT, AuditRun, same_runs, seen_in, trained
from vae_ddp.fixes import noise, registry

M = "examples.audit_models"


def base() -> AuditRun:
    return AuditRun(model={"class_path": f"{M}.Plain"}, data={"class_path": f"{M}.Regression"}, devices=2, steps=3)


def test_every_audit_trains_its_reference_floors_and_ddp_runs_and_a_factor_only_where_seen(tmp_path):
    p = plan(base(), tmp_path, [])
    runs = {r.label: r for r in p.one_device + p.ddp}
    always = [label for label, r in runs.items() if not r.if_seen]
    assert always == ["single", "floor-1", "floor-2", "floor-3", "floor-4", "other-batch", "permuted",
                      "effect-single", "ddp", "ddp+fixed", "ddp+fixed-forced", "ddp-forced", "effect-defaults"], always
    # DDP with every fix measures the effect of what only the user's code fixes: where something is left for it
    assert runs["effect-fixed"].if_seen == [LEFT]
    assert [r.label for r in p.ddp[:2]] == list(DECIDING)  # first: every conditional run waits for them
    for key in registry.audit_fixable():
        assert runs[f"ddp-{key}"].if_seen == [key] and runs[f"ddp+{key}"].if_seen == [key]
        assert runs[f"effect-{key}"].if_seen == effects.measured_by(key)
    # the buffers' check, where the deciding runs see draws no automatic fix serves, last in each group
    assert [p.one_device[-1].label, p.ddp[-1].label] == list(KEYED)
    assert p.one_device[-1].if_seen == p.ddp[-1].if_seen == [DRAWS_LEFT]
    assert p.one_device[-1].keyed_draws and p.ddp[-1].keyed_draws and p.ddp[-1].teacher_forced


def test_a_fix_that_removes_another_factor_measures_its_effect_too():
    """The reduction's padding is measured by the sampler's runs, the optimizer by the noise's
    (``effects.attach``): their effect runs train when either is seen."""
    by = {key: effects.measured_by(key) for key in registry.audit_fixable()}
    for f in registry.factors():
        other = f.ablated_with or f.fixed_by
        if other:
            assert f.key in by[other], (f.key, other, by)
    assert all(key == measured[0] for key, measured in by.items())


def test_the_buffers_check_follows_the_one_process_checks_and_is_not_planned_where_draws_are_keyed(tmp_path):
    static = [{"factor": noise.FACTOR.key, "evidence": "a collate_fn draws", "fix": "", "manual": True}]
    p = plan(base(), tmp_path / "a", static)
    assert p.one_device[-1].label == KEYED[0] and p.one_device[-1].if_seen == [HAS_BUFFERS]
    # a one-process check's finding is left for the user's code: DDP with every fix measures its effect
    assert next(r for r in p.ddp if r.label == "effect-fixed").if_seen == []
    keyed = [{"factor": noise.FACTOR.key, "evidence": "torch.randn", "fix": "", "torch_draws": ["torch.randn"]}]
    p = plan(base(), tmp_path / "b", keyed)
    assert p.base.keyed_draws and not {r.label for r in p.one_device + p.ddp} & set(KEYED)


def test_what_the_deciding_runs_saw():
    found = [{"factor": "sampler"}, {"factor": "batchnorm", "manual": False},
             {"factor": "reduction", "manual": True}]
    assert seen_in("ddp", found, has_buffers=False) == {"sampler", "batchnorm", LEFT}
    assert seen_in("ddp", found[:2], has_buffers=False) == {"sampler", "batchnorm"}
    assert seen_in("ddp+fixed", found[:2], has_buffers=False) == set()  # every fix on: no factor's own exposure
    left = [{"factor": noise.FACTOR.key, "manual": True}]
    assert seen_in("ddp+fixed", left, has_buffers=True) == {DRAWS_LEFT, HAS_BUFFERS, LEFT}
    assert seen_in("ddp+fixed", left, has_buffers=False) == {LEFT}
    unkeyed = [{"factor": noise.FACTOR.key, "manual": True, "unkeyed": True}]
    assert seen_in("ddp+fixed", unkeyed, has_buffers=True) == {HAS_BUFFERS, LEFT}
    run = base().replace(if_seen=["sampler", "reduction"])
    assert trained(run, {"reduction"}) and not trained(run, {"batchnorm", DRAWS_LEFT}) and trained(base(), set())


def test_runs_that_differ_by_fixes_that_change_nothing_train_once(tmp_path):
    """With the noise's and BatchNorm's fixes idle (no draw, no BatchNorm layer) and the sampler alone
    exposed, its runs are those with no fix and with every fix; the runs trained always are kept."""
    p = plan(base(), tmp_path, [])
    runs = p.ddp[2:]  # those after the deciding runs
    assert same_runs(runs, {"sampler", LEFT}, {"noise", "batchnorm"}) == {
        "ddp-sampler": "ddp-forced", "ddp+sampler": "ddp+fixed-forced", "effect-sampler": "effect-defaults"}
    # the noise exposed, its fix idle (draws it does not serve): its ablation is every fix, its effect every fix's
    # (both runs of the effect trained only where seen: the first in the plan's order trains)
    assert same_runs(runs, {"noise", LEFT}, {"noise", "batchnorm"}) == {
        "ddp-noise": "ddp+fixed-forced", "ddp+noise": "ddp-forced", "effect-fixed": "effect-noise"}
    assert same_runs(runs, {"sampler"}, {"noise", "batchnorm"}) == {
        "ddp-sampler": "ddp-forced", "ddp+sampler": "ddp+fixed-forced", "effect-sampler": "effect-defaults"}
    assert same_runs(runs, {"sampler"}, set()) == {}  # no fix idle: every run computes its own
    # BatchNorm and the sampler exposed, the noise's fix idle (a ResNet): each ablation is the other's fix alone
    # (the first of two in the plan's order trains)
    assert same_runs(runs, {"sampler", "batchnorm"}, {"noise"}) == {
        "ddp+batchnorm": "ddp-sampler", "ddp+sampler": "ddp-batchnorm"}
