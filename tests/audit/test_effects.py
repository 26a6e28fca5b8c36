"""The audit's effects (vae_ddp.audit.effects): what each exposed factor changes in what DDP trains.

Two factors whose answer is known without the audit:

- a clean MLP (``Plain``) whose one device reads the data in order while Lightning's
  DistributedSampler shuffles: DDP takes other samples, each sample once per epoch on both sides,
  so its step has one device's distribution (the one-step difference is large all the same);
- per-rank BatchNorm (``WithBatchNorm``, 8 samples per rank of a global batch of 16 from 64):
  the running statistics DDP keeps are rank 0's, written from 8 samples, so what each batch writes
  into them varies as a mean of 8 of 64 samples does against one of 16: ``2 (64 - 8) / (64 - 16)
  = 2.33`` times the variance (sampling without replacement; a variance's estimate: about
  ``15 / 7 = 2.14``).
"""

from __future__ import annotations

import pytest

from test_study import M, audit, by_factor
from vae_ddp.audit import effects
from vae_ddp.harness.effect import BIAS_MARGIN, RATIO_MARGIN

KEYS = {"kind", "bias", "bias_ci", "variance_ratio", "variance_ratio_ci"}


def test_a_clean_mlps_sampler_is_the_same_distribution(tmp_path):
    code, result, log = audit(tmp_path, f"{M}.Plain", "--data.init_args.shuffle", "false")
    assert code == 0, log[-3000:]  # the exit code is the exact reproduction's, as before
    sampler = by_factor(result)["sampler"]
    assert sampler["exposed"] and sampler["contribution"] > 0.1  # one step: other samples, another gradient
    e = sampler["effect"]
    assert set(e) >= KEYS and e["kind"] == "same distribution", e
    assert (e["bias_ci"][1] < BIAS_MARGIN
            and 1 / RATIO_MARGIN < e["variance_ratio_ci"][0] <= 1 <= e["variance_ratio_ci"][1])
    assert result["effect_rows"] == effects.ROWS and result["effect"]["kind"] == "same distribution"
    assert all(f["effect"] is None for f in result["findings"] if not f["exposed"])
    assert "| Sampler and data order | only which samples or draws |" in log


def test_per_rank_batchnorm_changes_what_ddp_trains(generated):
    """The audit the site shows (registry entry ``audit_batchnorm``), read, not rerun."""
    result = generated("audit_batchnorm", "audit.json")
    f = by_factor(result)
    e = f["batchnorm"]["effect"]
    assert e["kind"] == "different" and e["quantity"] == "buffers", e
    lo, hi = e["variance_ratio_ci"]
    assert 1 < lo <= 15 / 7 and hi >= 2 * 56 / 48, e  # the truth of sampling theory inside the interval
    assert f["sampler"]["effect"]["kind"] == "exact"  # shuffled: Lightning deals the permutation one device takes
    assert result["findings"][0]["factor"] == "batchnorm" and result["effect"]["kind"] == "different"


def test_what_changes_what_ddp_trains_ranks_first():
    """Among the exposed rows: a difference in what DDP trains above a factor not measured, above
    one that changes only the luck, whatever their one-step contributions."""
    from vae_ddp.audit.judge import _rank

    def f(name, kind=None, contribution=None, bites=None, automatic=True):
        return dict(factor=name, exposed=True, automatic_fix=automatic, contribution=contribution, bites=bites,
                    left_after_fixes=None, effect=None if kind is None else {"kind": kind})

    rows = [f("luck", "same distribution", 2.0, True), f("model", "different", 1e-3, True),
            f("yours", automatic=False), f("same", "exact", 1e-16, False), f("unresolved", "inconclusive", 0.5, True)]
    assert [r["factor"] for r in sorted(rows, key=_rank)] == ["model", "unresolved", "yours", "luck", "same"]


@pytest.mark.parametrize("kind, words", [("different", "what DDP trains"),
                                         ("same distribution", "only which samples or draws"),
                                         ("exact", "nothing: the same step"), ("inconclusive", "not resolved")])
def test_the_table_words_each_kind(kind, words):
    e = dict(kind=kind, bias=0.1, bias_ci=[0, 0.2], variance_ratio=1.0, variance_ratio_ci=[0.8, 1.2],
             quantity="gradient")
    result = {"findings": [dict(factor="sampler", effect=e)], "effect": None, "effect_rows": 32}
    lines = effects.render(result, str)
    assert (f"| sampler | {words} " in "\n".join(lines)
            and lines[-1] == "- sampler: bias 0.1 [0, 0.2] sd, noise ratio 1 [0.8, 1.2], on the gradient")
    assert effects.render({"findings": [dict(factor="sampler", effect=None)]}, str) == []
