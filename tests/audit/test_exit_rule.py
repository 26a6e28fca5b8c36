"""The audit's exit rule (vae_ddp.audit.exit_rule): does DDP, as the user runs it, train one device's
model? On made-up results: every factor's mechanism as its fix module declares it, with and without the
audit's fixes; and the findings that say their own."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(60)


def _row(factor: str, exposed: bool = True, findings: list | None = None) -> dict:
    from vae_ddp.audit.exit_rule import mechanism

    return {"factor": factor, "exposed": exposed, "mechanism": mechanism(factor, findings or []) if exposed else None}


def _result(*rows: dict, deterministic: bool = True, within_floor: bool = True) -> dict:
    return {"deterministic": deterministic, "within_floor": within_floor, "findings": list(rows)}


@pytest.mark.parametrize("factor", ["noise", "batchnorm", "gradient_scale", "update", "buffers", "parameters"])
def test_a_difference_shown_by_its_mechanism_is_1_even_where_a_fix_closes_it(factor):
    from vae_ddp.audit.exit_rule import decide

    d = decide(_result(_row(factor), _row("sampler")))
    assert d == {"code": 1, "why": [factor]}, d
    assert decide(_result(_row(factor, exposed=False)))["code"] == 0


def test_other_samples_the_plot_and_what_follows_are_0():
    """Lightning's shuffling DistributedSampler (other samples of one device's distribution), its padding of
    the last batch (the reduction with the audit's fix), the plot, Adam's step sizes under shared noise."""
    from vae_ddp.audit.exit_rule import decide

    padding = [{"factor": "reduction", "mechanism": "same distribution"}]  # the reduction module's padding finding
    rows = [_row("sampler"), _row("reduction", findings=padding), _row("logging"), _row("optimizer")]
    assert decide(_result(*rows)) == {"code": 0, "why": []}


def test_a_finding_names_its_own_mechanism():
    """A sampler whose stream gives every rank the same batches is another model; a reduction only the
    user's code fixes (a summed or coupled loss) too."""
    from vae_ddp.audit.exit_rule import decide

    unsharded = [{"factor": "sampler", "mechanism": "another model"}, {"factor": "sampler"}]
    assert decide(_result(_row("sampler", findings=unsharded)))["code"] == 1
    assert decide(_result(_row("reduction")))["code"] == 1  # a summed, weighted or coupled loss


def test_not_judged_and_not_within_the_floor_are_1():
    from vae_ddp.audit.exit_rule import decide

    assert decide(_result(deterministic=False))["code"] == 1
    d = decide(_result(_row("sampler"), within_floor=False))
    assert d["code"] == 1 and "not within 2x its floor" in d["why"][0]
    assert decide(_result())["code"] == 0


def test_not_within_the_floor_names_the_parts_that_are_not():
    """The reason names what is not within its floor (``apart``), where the judgement knows it."""
    from vae_ddp.audit.exit_rule import decide

    d = decide(dict(_result(within_floor=False), apart=["the learning rate at step 1"]))
    why = "with every fix, DDP's step is not within 2x its floor: the learning rate at step 1"
    assert d == {"code": 1, "why": [why]}, d


def test_the_parts_apart_are_named_and_a_gradient_within_its_floor_is_not():
    from vae_ddp.audit.exit_rule import apart

    first = [{"part": "learning rate", "step": 2}]
    assert apart(True, 0.675, first, 3.0, 3) == ["the learning rate at step 2"]
    assert apart(False, 5.0, None, 1e4, 3) == ["the gradient, 5x its floor",
                                               "the parameters after 3 steps, 1e+04x their floor"]
    assert apart(True, 0.5, [], 1.0, 3) == []
