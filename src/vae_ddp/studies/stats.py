"""Statistics of the seed study: Welch's t-test and the confidence interval of a difference of means."""

from __future__ import annotations

import math
import statistics
from typing import Sequence

from scipy import stats as sps

__all__ = ["welch"]


def welch(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> dict[str, float]:
    """Compare the means of two independent samples without assuming equal variances.

    Returns ``mean_a``, ``std_a``, ``mean_b``, ``std_b`` (sample standard deviations),
    ``diff`` (``mean_a - mean_b``), ``ci_low``/``ci_high`` (``confidence`` interval of the
    difference with the Welch-Satterthwaite degrees of freedom ``df``), ``t`` and the
    two-sided ``p`` of ``scipy.stats.ttest_ind(a, b, equal_var=False)``.

    Raises:
        ValueError: fewer than 2 values in either sample.
    """
    if len(a) < 2 or len(b) < 2:
        raise ValueError("Welch's test needs at least 2 values per group")
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    va, vb = statistics.variance(a), statistics.variance(b)
    se2 = va / len(a) + vb / len(b)
    se = math.sqrt(se2)
    if se == 0:
        df, half, t, p = float("nan"), 0.0, float("nan"), float("nan")
    else:
        df = se2**2 / ((va / len(a)) ** 2 / (len(a) - 1) + (vb / len(b)) ** 2 / (len(b) - 1))
        half = float(sps.t.ppf(0.5 + confidence / 2, df)) * se
        res = sps.ttest_ind(a, b, equal_var=False)
        t, p = float(res.statistic), float(res.pvalue)
    return {"mean_a": ma, "std_a": math.sqrt(va), "mean_b": mb, "std_b": math.sqrt(vb), "diff": ma - mb,
            "ci_low": ma - mb - half, "ci_high": ma - mb + half, "df": df, "t": t, "p": p}
