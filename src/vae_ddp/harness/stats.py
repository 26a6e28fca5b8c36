"""Statistics of the seed studies: difference, equivalence and power, from scipy and statsmodels.

A study compares a configuration ``a`` with a reference ``b`` (``single``, or independent noise)
on several final quantities ("metrics"), one value per seed. For each metric:

- the difference of means with its confidence interval and two-sided p-value:
  paired (``scipy.stats.ttest_rel``) when run i of ``a`` and run i of ``b`` share something
  that makes them alike (the same seed, hence the same initial weights), else Welch's test
  (``scipy.stats.ttest_ind(equal_var=False)``);
- an equivalence test, two one-sided tests (TOST, Schuirmann 1987) against a margin ``±m``:
  ``statsmodels.stats.weightstats.ttost_paired`` / ``ttost_ind(usevar="unequal")``;
- the smallest difference the study detects with 80% power (two-sided), from
  ``statsmodels.stats.power.TTestPower`` (paired) / ``TTestIndPower`` (independent) at the
  strictest Holm level ``alpha / k``;
- Holm's correction (Holm 1979, ``statsmodels.stats.multitest.multipletests(method="holm")``)
  over the ``k`` metrics of one comparison, separately for the difference tests and the
  equivalence tests.

The verdict of a metric: ``"different"`` when the Holm-adjusted difference p is below
``alpha`` (a systematic difference is detected; ``within_margin`` then says whether it is
also shown to be smaller than ``m``), else ``"equivalent"`` when the Holm-adjusted TOST p
is below ``alpha`` (the difference is shown to lie within ``±m``), else ``"inconclusive"``
(neither: the study is too small for this margin).
"""

from __future__ import annotations

import math
import statistics
from typing import Mapping, Sequence

import numpy as np
from scipy import stats as sps

__all__ = ["welch", "paired", "tost", "detectable_difference", "compare_metrics", "finals", "QUANTITIES", "VERDICTS"]

#: The three outcomes of a comparison, in the order the pages list them.
VERDICTS = ("equivalent", "different", "inconclusive")
#: The final values of a run that the seed studies compare (``finals``).
QUANTITIES = ("train_kl", "train_recon_loss", "val_kl", "val_recon_loss")


def finals(records: Sequence[Mapping], val: Mapping) -> dict[str, float]:
    """A run's final values (``QUANTITIES``): the train KL and reconstruction loss (global batch)
    as means over the last 10% of its steps' ``records``, validation's from its last ``val`` record."""
    n = max(1, len(records) // 10)
    return {"train_kl": statistics.fmean(r["kl"] for r in records[-n:]),
            "train_recon_loss": statistics.fmean(r["recon_loss"] for r in records[-n:]),
            "val_kl": val["kl"], "val_recon_loss": val["recon_loss"]}


def _check(a: Sequence[float], b: Sequence[float], pair: bool) -> None:
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"a t-test needs at least 2 values per group, got {len(a)} and {len(b)}")
    if pair and len(a) != len(b):
        raise ValueError(f"a paired test needs groups of equal size, got {len(a)} and {len(b)}")


def _result(res, a: Sequence[float], b: Sequence[float], confidence: float) -> dict[str, float]:
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    out = {"mean_a": ma, "std_a": statistics.stdev(a), "mean_b": mb, "std_b": statistics.stdev(b), "diff": ma - mb}
    if math.isnan(float(res.statistic)):  # no spread at all: scipy returns nan
        return out | {"ci_low": ma - mb, "ci_high": ma - mb, "df": float(res.df), "t": math.nan, "p": math.nan}
    ci = res.confidence_interval(confidence)
    return out | {"ci_low": float(ci.low), "ci_high": float(ci.high), "df": float(res.df),
                  "t": float(res.statistic), "p": float(res.pvalue)}


def welch(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> dict[str, float]:
    """Compare the means of two independent samples without assuming equal variances.

    Returns ``mean_a``, ``std_a``, ``mean_b``, ``std_b`` (sample standard deviations),
    ``diff`` (``mean_a - mean_b``), and from ``scipy.stats.ttest_ind(a, b, equal_var=False)``:
    ``df`` (Welch-Satterthwaite), ``ci_low``/``ci_high`` (its ``confidence_interval``),
    ``t`` and the two-sided ``p``.

    Raises:
        ValueError: fewer than 2 values in either sample.
    """
    _check(a, b, pair=False)
    return _result(sps.ttest_ind(a, b, equal_var=False), a, b, confidence)


def paired(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> dict[str, float]:
    """Compare the means of two samples paired by position (``a[i]`` with ``b[i]``).

    Same keys as [`welch`][vae_ddp.harness.stats.welch], from ``scipy.stats.ttest_rel(a, b)``
    (``df = n - 1``), plus ``std_diff`` (standard deviation of ``a[i] - b[i]``) and ``r``
    (Pearson correlation of ``a`` and ``b``: how much the pairing narrows the interval).

    Raises:
        ValueError: fewer than 2 values, or groups of different sizes.
    """
    _check(a, b, pair=True)
    out = _result(sps.ttest_rel(a, b), a, b, confidence)
    out["std_diff"] = statistics.stdev([x - y for x, y in zip(a, b)])
    out["r"] = statistics.correlation(a, b) if out["std_a"] > 0 and out["std_b"] > 0 else math.nan
    return out


def margin_interval(c: Mapping[str, float], k: int = len(QUANTITIES),
                    alpha: float = 0.05) -> tuple[float, float] | None:
    """The interval that decides a paired difference against the equivalence margin at the level
    of Holm's correction over ``k`` quantities: the two-sided ``1 - 2 alpha / k`` interval (97.5% for
    4). Inside ``±margin`` it is the equivalence test (TOST, Schuirmann 1987) at ``alpha / k``, Holm's
    strictest step, so it holds every Holm-adjusted equivalence decision; wholly beyond the margin it
    shows the difference larger than the margin by the one-sided test at the same level.

    ``c``: a [`paired`][vae_ddp.harness.stats.paired] result (``diff``, ``std_diff``, ``df``);
    None where it has none of these (a Welch comparison). Student's t with ``df`` degrees of
    freedom (``scipy.stats.t``)."""
    if not all(key in c for key in ("diff", "std_diff", "df")):
        return None
    half = float(sps.t.ppf(1 - alpha / k, c["df"])) * c["std_diff"] / (c["df"] + 1) ** 0.5
    return c["diff"] - half, c["diff"] + half


def margin_level(k: int = len(QUANTITIES), alpha: float = 0.05) -> str:
    """``97.5%``: the level of :func:`margin_interval` for ``k`` quantities, as printed."""
    return f"{(1 - 2 * alpha / k) * 100:.4g}%"


def tost(a: Sequence[float], b: Sequence[float], margin: float, pair: bool) -> float:
    """p-value of the two one-sided tests of ``H0: |mean(a) - mean(b)| >= margin``.

    A small p shows that the difference lies within ``(-margin, margin)``. Paired:
    ``statsmodels.stats.weightstats.ttost_paired``; independent: ``ttost_ind`` with
    unequal variances (Welch). ``p < alpha`` is the same as the ``1 - 2 alpha``
    confidence interval lying inside the margin.

    Raises:
        ValueError: ``margin`` not positive, or the inputs of [`paired`][vae_ddp.harness.stats.paired].
    """
    from statsmodels.stats.weightstats import ttost_ind, ttost_paired

    _check(a, b, pair)
    if not margin > 0:
        raise ValueError(f"the equivalence margin must be positive, got {margin}")
    if pair:
        p = ttost_paired(np.asarray(a, float), np.asarray(b, float), -margin, margin)[0]
    else:
        p = ttost_ind(np.asarray(a, float), np.asarray(b, float), -margin, margin, usevar="unequal")[0]
    return float(p)


def detectable_difference(n: int, sd: float, pair: bool, alpha: float = 0.05, power: float = 0.8) -> float:
    """Smallest true difference of means a two-sided t-test at level ``alpha`` detects with
    probability ``power``, in the units of ``sd``.

    Paired (``n`` pairs): ``TTestPower`` effect size times ``sd`` = the standard deviation
    of the differences. Independent (``n`` per group): ``TTestIndPower`` effect size
    (Cohen's d) times ``sd`` = the pooled standard deviation.
    """
    from statsmodels.stats.power import TTestIndPower, TTestPower

    if pair:
        d = TTestPower().solve_power(nobs=n, alpha=alpha, power=power, alternative="two-sided")
    else:
        d = TTestIndPower().solve_power(nobs1=n, ratio=1.0, alpha=alpha, power=power, alternative="two-sided")
    return float(d) * sd


def _holm(pvalues: list[float]) -> list[float]:
    from statsmodels.stats.multitest import multipletests

    ok = [i for i, p in enumerate(pvalues) if not math.isnan(p)]
    adjusted = [math.nan] * len(pvalues)
    if ok:
        for i, q in zip(ok, multipletests([pvalues[i] for i in ok], method="holm")[1]):
            adjusted[i] = float(q)
    return adjusted


def compare_metrics(a: Mapping[str, Sequence[float]], b: Mapping[str, Sequence[float]],
                    margins: Mapping[str, float], pair: bool, alpha: float = 0.05) -> dict[str, dict]:
    """Compare ``a`` with the reference ``b`` on every metric; Holm over the metrics.

    Args:
        a, b: ``{metric: values}``, one value per seed (paired: the same seeds, same order).
        margins: ``{metric: m}``, the equivalence margin of each metric (positive).
        pair: paired tests (see [`paired`][vae_ddp.harness.stats.paired]) or Welch's.
        alpha: familywise error rate over the metrics, for each kind of test.

    Returns:
        ``{metric: entry}``: the keys of [`paired`][vae_ddp.harness.stats.paired] or
        [`welch`][vae_ddp.harness.stats.welch], ``test`` (``"paired"``/``"welch"``),
        ``p_holm``, ``margin``, ``p_tost``, ``p_tost_holm``, ``mde`` (smallest difference
        detected with 80% power at level ``alpha / k``), ``within_margin`` (Holm-adjusted
        TOST p below ``alpha``) and ``verdict`` (one of :data:`VERDICTS`).
    """
    metrics = list(a)
    out = {}
    for q in metrics:
        e = paired(a[q], b[q]) if pair else welch(a[q], b[q])
        sd = e["std_diff"] if pair else math.sqrt((e["std_a"] ** 2 + e["std_b"] ** 2) / 2)
        e.update(test="paired" if pair else "welch", margin=margins[q],
                 p_tost=tost(a[q], b[q], margins[q], pair) if sd > 0 else math.nan,
                 mde=detectable_difference(len(a[q]), sd, pair, alpha / len(metrics)))
        out[q] = e
    for key, holm_key in (("p", "p_holm"), ("p_tost", "p_tost_holm")):
        for q, v in zip(metrics, _holm([out[q][key] for q in metrics])):
            out[q][holm_key] = v
    for e in out.values():
        e["within_margin"] = bool(e["p_tost_holm"] < alpha)
        e["verdict"] = ("different" if e["p_holm"] < alpha else
                        "equivalent" if e["within_margin"] else "inconclusive")
    return out
