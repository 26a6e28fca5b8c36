"""Same model, or different luck: DDP's step against one device's, split into a bias and a noise ratio.

One step of DDP differs from one device's step for two kinds of reasons. Some change what DDP
trains: its step is off one device's on average (a bias: per-rank BatchNorm statistics), or it
is noisier or quieter (a noise ratio: a dropout mask or a noise vector repeated on every rank, which
Adam's second moment feels). Others change only the luck: DDP takes other samples or other draws
(``DistributedSampler``'s order), from the same distribution as one device. A one-step difference
cannot tell the two apart; the distribution of many steps can.

[`decompose`][vae_ddp.harness.effect.decompose] reads ``n`` paired rows: row ``i`` is one device's
step ``x_i`` and DDP's step ``y_i`` (vectors of ``P`` numbers: the gradient or the update, or one
number: a loss term, a logged value), both from the same weights, for a global batch and a draw of
the seeds (the same global batch where DDP takes it, another one where its sampler does). Rows of
the same weights form a group (``groups``); the spread is taken within each group, the bias of
each group separately, so a step that changes with the weights is no spread and biases of opposite
sign at two points do not cancel. With ``d_i = y_i - x_i`` and ``G`` groups:

- ``sd``: one device's step-to-step standard deviation at the same weights,
  ``sqrt(tr S_x)``, ``S_x`` the within-group covariance of ``x`` (``n - G`` degrees of freedom);
- ``bias``: ``sqrt(sum_g n_g ||mean_g(d)||^2 / n) / sd``, the root mean square over the rows of
  the mean difference of their group, in units of ``sd``, its square estimated without the part
  the noise adds (``sum_g n_g ||mean_g d||^2 - G tr S_d``, ``S_d`` the within-group covariance of
  ``d``); 0 when that is negative;
- ``variance_ratio``: ``tr S_y / tr S_x``, DDP's step-to-step variance over one device's.

Intervals (``confidence``, 0.95 by default), both from scipy's F distributions, with the effective
number of dimensions of a vector ``d_eff = (tr S)^2 / tr(S^2)`` (Box 1954: a sum of ``P``
correlated chi-squares taken as one scaled chi-square with the same first two moments; 1 for one
number, exact for a normal scalar). ``d_eff`` is computed from the sample covariance, which
underestimates it for few rows: fewer degrees of freedom, wider intervals, never narrower.

- the noise ratio: the union of two intervals. (1) ``tr S_y / tr S_x`` over the F distribution with
  ``(n - G) d_eff(S_y)`` and ``(n - G) d_eff(S_x)`` degrees of freedom (``scipy.stats.f``), the
  interval of a ratio of two independent variances, exact for normal rows (``x_i`` and ``y_i`` of the
  same row are often alike, the same samples: that only narrows the true interval). (2) The rows'
  jackknife of ``log(tr S_y / tr S_x)`` with Student's t (``_jackknife_ratio``), which assumes no
  distribution. The F interval alone is too narrow when one row carries most of the spread (a
  heavy-tailed quantity, such as the KL of a global batch at the report's scale): on rows where one
  batch in 24 has 20 times the others' variance (true ratio 1.5) it misses the truth in over 20% of
  1,000 simulated studies, the union in at most 6% (tests/harness/test_effect.py asserts both). Not a
  bootstrap: with a handful of rows per group a bootstrap's percentile interval is too narrow (it
  resamples the few rows it has); the jackknife's t widens with the few rows;
- the bias: ``T = (sum_g n_g ||mean_g d||^2 / G) / tr S_d`` is F-distributed with ``G d_eff(S_d)``
  and ``(n - G) d_eff(S_d)`` degrees of freedom when DDP's step has no bias, noncentral F with
  ``lambda = d_eff sum_g n_g ||bias_g||^2 / tr S_d`` when it has; the interval of ``lambda``
  inverts ``scipy.stats.ncf`` (as the interval of a standardised effect size inverts the
  noncentral t) and is reported in units of ``sd`` (``sd`` itself taken as known). The test
  assumes independent rows. Rows drawn without replacement from a small data set are not: over
  one epoch both sides take every sample once, and the mean difference holds far less noise than
  ``tr S_d`` says. Given ``blocks`` (the epochs), each block's mean difference is one observation
  instead; and whenever ``T`` falls below the central F's ``(1 - confidence) / 2`` quantile (the
  differences more alike than independent ones), the interval's upper end is not claimed (inf).
  A bias whose lower end is within ``floor`` times the rows' size is rounding: not detected.

The kind (:data:`KINDS`), by these rules (:func:`classify`, unit-tested):

- ``exact``: every row's ``||d_i||`` is within ``floor * ||x_i||`` (the rounding floor the caller
  measured; 0: the same bits): the same draw gives the same step;
- ``different``: the bias interval excludes 0 or the noise ratio interval excludes 1: a difference
  in what DDP trains is detected (at ``1 - confidence``, two-sided); its size is the bias and the
  ratio, however small;
- ``same distribution``: neither, and both intervals lie inside the margins, ``bias`` below
  :data:`BIAS_MARGIN` (half of one device's step-to-step standard deviation) and the noise ratio
  between ``1 / RATIO_MARGIN`` and :data:`RATIO_MARGIN` (half or twice the variance): shown to
  differ by no more than the margins, what other samples and draws of one distribution do;
- ``inconclusive``: neither detected nor shown within the margins: too few rows for these margins.

The margins are what a change of luck is allowed: a bias of half a step's spread per step, a
variance halved or doubled (a batch of ``B/2`` or ``2B`` would double or halve it). False alarms:
the bias interval's lower bound is a one-sided test at ``(1 - confidence) / 2`` (2.5%), the noise
ratio's a two-sided one at ``1 - confidence`` (5%): ``different`` for a step of one distribution in
at most 7.5% of studies (measured on synthetic steps: 2-3% and about 1% for one normal number of 16
rows, fewer for vectors, whose ``d_eff`` the sample underestimates; the bias 2-3% also on the
heavy-tailed rows above; tests/harness/test_effect.py). Showing ``same distribution`` takes rows:
about 30 for a gradient of a few effective dimensions.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
from scipy import optimize
from scipy import stats as sps

__all__ = ["decompose", "classify", "describe", "detected", "KINDS", "BIAS_MARGIN", "RATIO_MARGIN", "CONFIDENCE",
           "CHANGES_TRAINING", "CHANGES_LUCK"]

#: The kinds of an effect, most serious first.
KINDS = ("different", "inconclusive", "same distribution", "exact")
#: ``same distribution`` needs the bias interval below this, in one device's step-to-step standard deviations.
BIAS_MARGIN = 0.5
#: ``same distribution`` needs the noise ratio interval within ``[1 / RATIO_MARGIN, RATIO_MARGIN]``.
RATIO_MARGIN = 2.0
#: Two-sided confidence of both intervals.
CONFIDENCE = 0.95
#: How the audit's table words the kinds.
CHANGES_TRAINING = "changes what DDP trains"
CHANGES_LUCK = "changes only which samples or draws"


def classify(exact: bool, bias_ci: Sequence[float], ratio_ci: Sequence[float],
             bias_margin: float = BIAS_MARGIN, ratio_margin: float = RATIO_MARGIN) -> str:
    """The kind of an effect (one of :data:`KINDS`) from its intervals, by the rules of this module:
    ``exact`` first, then ``different`` (an interval excludes 0 or 1), ``same distribution`` (both
    inside the margins), else ``inconclusive``. NaN bounds are never inside anything."""
    if exact:
        return "exact"
    (b_lo, b_hi), (r_lo, r_hi) = bias_ci, ratio_ci
    if b_lo > 0 or r_lo > 1 or r_hi < 1:
        return "different"
    if b_hi < bias_margin and 1 / ratio_margin < r_lo and r_hi < ratio_margin:
        return "same distribution"
    return "inconclusive"


def describe(effect: Optional[dict]) -> str:
    """The effect in a few words for a table cell: ``exact``, ``luck only``, ``trains: bias 0.82 sd``,
    ``trains: noise 1.9x``, ``unresolved``; empty for no effect."""
    if not effect:
        return ""
    kind = effect["kind"]
    if kind == "exact":
        return "exact"
    if kind == "same distribution":
        return "luck only"
    if kind == "inconclusive":
        return "unresolved"
    return "trains: " + ", ".join(detected(effect))


def detected(effect: dict, number=lambda v: f"{v:.2g}") -> list[str]:
    """What a ``different`` effect's intervals resolve, each written with ``number``: ``bias 0.82 sd``
    (the bias interval above 0), ``noise 1.9x`` (the variance ratio's interval excludes 1)."""
    parts = []
    if effect["bias_ci"][0] > 0:
        parts.append(f"bias {number(effect['bias'])} sd")
    r_lo, r_hi = effect["variance_ratio_ci"]
    if r_lo > 1 or r_hi < 1:
        parts.append(f"noise {number(effect['variance_ratio'])}x")
    return parts


def _rows(a) -> np.ndarray:
    """Rows as an ``(n, P)`` float64 array (a sequence of vectors or of numbers)."""
    out = np.asarray([np.asarray(r, dtype=np.float64).reshape(-1) for r in a])
    return out.reshape(len(out), -1)


def _centred(z: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(z minus its group's mean, the group means)``, one row per group in ``np.unique`` order."""
    keys = np.unique(groups)
    means = np.stack([z[groups == g].mean(axis=0) for g in keys])
    return z - means[np.searchsorted(keys, groups)], means


def _spread(zc: np.ndarray, dof: int, z: np.ndarray) -> tuple[float, float]:
    """``(tr S, d_eff)`` of within-group centred rows ``zc`` (of the rows ``z``): ``S = zc^T zc / dof``,
    ``d_eff = (tr S)^2 / tr(S^2)`` from the ``n x n`` Gram matrix (never ``P x P``). A spread within a
    few roundings of the rows' values (what subtracting a mean leaves of equal rows) is none: 0, ``d_eff`` 1."""
    gram = zc @ zc.T
    trace = float(np.trace(gram)) / dof
    if trace <= (8 * np.finfo(np.float64).eps) ** 2 * float((z * z).sum(axis=1).max(initial=0.0)):
        return 0.0, 1.0
    square = float((gram * gram).sum()) / dof ** 2
    return trace, (trace * trace / square if square > 0 else 1.0)


def _noncentrality(t: float, dfn: float, dfd: float, p: float) -> float:
    """The ``lambda`` at which the noncentral F's cdf at ``t`` is ``p`` (0 when it is below ``p`` already at 0).
    Far in the tail, where scipy's ``ncf`` returns NaN, from the normal approximation of
    ``t dfn`` (mean ``dfn + lambda``, variance ``2 (dfn + 2 lambda) + (dfn + lambda)^2 2 / dfd``)."""
    def f(lam: float) -> float:
        return float(sps.ncf.cdf(t, dfn, dfd, lam)) - p

    if f(0.0) <= 0:
        return 0.0
    hi = max(1.0, t * dfn)
    value = f(hi)
    while value > 0 and hi < 1e12:
        hi *= 2
        value = f(hi)
    if math.isnan(value) or value > 0:
        z = float(sps.norm.ppf(p))
        return float(optimize.brentq(
            lambda lam: t * dfn - (dfn + lam) - z * math.sqrt(2 * (dfn + 2 * lam) + 2 * (dfn + lam) ** 2 / dfd),
            0.0, 10 * t * dfn + 10)) if t * dfn - dfn - z * math.sqrt(2 * dfn + 2 * dfn ** 2 / dfd) > 0 else 0.0
    return float(optimize.brentq(f, 0.0, hi, xtol=1e-10, rtol=1e-8))


def decompose(single, ddp, groups: Optional[Sequence] = None, floor: float = 0.0,
              confidence: float = CONFIDENCE, blocks: Optional[Sequence] = None) -> dict:
    """One device's steps against DDP's, paired by row: the bias, the noise ratio and the kind.

    Args:
        single: one device's steps, ``n`` rows (``n >= G + 1``, at least 2 rows in some group): a
            sequence of vectors of one length ``P`` (numpy arrays, torch tensors, lists), or of numbers.
        ddp: DDP's steps, ``n`` rows like ``single``'s, row ``i`` from the same weights and the same
            global batch and draw where DDP takes them.
        groups: ``n`` labels, the rows with the same weights (default: all one group).
        floor: the relative rounding floor: a row counts as the same step when
            ``||y_i - x_i|| <= floor * ||x_i||``; every row within it is ``exact``. A bias whose lower
            bound is within ``floor`` times the rows' root mean square size is not detected (its lower bound 0).
        confidence: two-sided confidence of the intervals.
        blocks: ``n`` labels of the rows that are not independent draws, within their group: the
            global batches of one epoch of a small data set, which take every sample once on both
            sides, so that their mean difference holds none of the batches' noise. The bias is then
            computed from the blocks' mean differences (each block one observation), where every
            group has two blocks or more; else from the rows.

    Returns:
        ``{"kind", "bias", "bias_ci": [lo, hi], "variance_ratio", "variance_ratio_ci": [lo, hi],
        "variance_ratio_ci_normal": the F interval alone (what it would be if the rows were normal),
        "largest_share": [of x, of y] (the share of each side's spread that its largest row carries),
        "sd", "rows", "groups", "dims": [d_eff of x, of y], "largest_row":
        max_i ||y_i - x_i|| / ||x_i||}``, floats (``bias`` in units of ``sd``; ``inf`` where one
        device's step does not vary and DDP's is off it, ``nan`` where neither varies).

    Raises:
        ValueError: rows of different counts or lengths, or no group with two rows.
    """
    x, y = _rows(single), _rows(ddp)
    if x.shape != y.shape:
        raise ValueError(f"one device's rows {x.shape} and DDP's {y.shape} differ: "
                         "pair every step of one with one of the other")
    n = len(x)
    g = np.zeros(n, dtype=int) if groups is None else np.unique(np.asarray(list(groups)), return_inverse=True)[1]
    if len(g) != n:
        raise ValueError(f"{len(g)} group labels for {n} rows")
    k = int(g.max()) + 1 if n else 0
    if n - k < 1:
        raise ValueError(f"{n} rows in {k} groups: the spread needs at least one group with two rows")
    d = y - x
    norms = np.linalg.norm(x, axis=1)
    rel = np.linalg.norm(d, axis=1) / np.where(norms > 0, norms, 1.0)
    largest = float(rel.max()) if n else 0.0
    dof = n - k
    (xc, _), (yc, _) = _centred(x, g), _centred(y, g)
    (tx, ex), (ty, ey) = _spread(xc, dof, x), _spread(yc, dof, y)
    alpha = 1 - confidence
    units, unit_groups = _units(d, g, blocks)
    ms, ms_ci, ed = _mean_square(units, unit_groups, alpha)
    if ms_ci[0] <= floor ** 2 * float((x * x).sum(axis=1).mean()):  # a mean difference within rounding: none detected
        ms_ci = [0.0, ms_ci[1]]
    bias, bias_ci = _in_sd(ms, tx), [_in_sd(v, tx) for v in ms_ci]
    if tx > 0 and ty > 0:
        ratio = ty / tx
        ratio_ci = [ratio / float(sps.f.ppf(1 - alpha / 2, dof * ey, dof * ex)),
                    ratio / float(sps.f.ppf(alpha / 2, dof * ey, dof * ex))]
        normal_ci = list(ratio_ci)
        jack = _jackknife_ratio(x, y, g, alpha)
        if jack is not None:  # the union: the F interval where the rows are normal, the jackknife's where not
            ratio_ci = [min(ratio_ci[0], jack[0]), max(ratio_ci[1], jack[1])]
    else:
        ratio = math.nan if tx == ty == 0 else (math.inf if tx == 0 else 0.0)
        ratio_ci = [ratio, ratio]
        normal_ci = list(ratio_ci)
    shares = [_largest_share(xc), _largest_share(yc)]
    exact = bool(np.all(np.linalg.norm(d, axis=1) <= floor * norms))
    if exact:
        bias, bias_ci, ratio, ratio_ci, normal_ci = 0.0, [0.0, 0.0], 1.0, [1.0, 1.0], [1.0, 1.0]
    return {"kind": classify(exact, bias_ci, ratio_ci), "bias": bias, "bias_ci": bias_ci,
            "variance_ratio": ratio, "variance_ratio_ci": ratio_ci, "variance_ratio_ci_normal": normal_ci,
            "largest_share": shares, "sd": math.sqrt(tx), "rows": n, "groups": k,
            "dims": [ex, ey], "largest_row": largest}


def _largest_share(zc: np.ndarray) -> float:
    """The share of the within-group spread (the sum of the centred rows' squared norms) that its
    largest row carries: ``1 / n`` where the rows share it evenly, near 1 where one row carries it all;
    0 where nothing varies."""
    w = (zc * zc).sum(axis=1)
    total = float(w.sum())
    return float(w.max()) / total if total > 0 else 0.0


def _centred_sums(gram: np.ndarray, g: np.ndarray) -> tuple[float, np.ndarray]:
    """``(sum of the within-group centred squared norms of all rows, the same sum without row i for
    each i)``, from the rows' Gram matrix ``gram`` (``n x n``) and their group labels ``g`` (0..G-1).
    A group's sum over its index set ``I`` is ``sum_I G_ii - sum_{I x I} G_ij / |I|``."""
    diag = np.diag(gram)
    total, loo = 0.0, np.empty(len(g))
    for grp in np.unique(g):
        idx = np.flatnonzero(g == grp)
        block = gram[np.ix_(idx, idx)]
        size, row_sums, whole = len(idx), block.sum(axis=1), float(block.sum())
        own = float(diag[idx].sum()) - whole / size
        total += own
        rest = size - 1
        without = (float(diag[idx].sum()) - diag[idx]
                   - ((whole - 2 * row_sums + diag[idx]) / rest if rest else 0.0))
        loo[idx] = without - own  # this group's sum without row i, minus its sum with it
    return total, total + loo


def _jackknife_ratio(x: np.ndarray, y: np.ndarray, g: np.ndarray, alpha: float) -> Optional[list[float]]:
    """The noise ratio's interval from the rows' jackknife: ``log(tr S_y / tr S_x)`` computed without each
    row in turn (the within-group spreads share their degrees of freedom, which cancel), its standard
    error ``sqrt((n - 1) / n sum_i (l_i - mean l)^2)`` (Efron & Stein 1981), and Student's t with the
    effective number of the leave-one-out values less one, ``3 (sum_i e_i^2)^2 / sum_i e_i^4 - 1``
    (``e_i = l_i - mean l``; about ``n - 1`` where they are normal, fewer where one row dominates),
    at most ``n - 1``. Unlike the F interval it assumes no distribution of the rows: a batch with
    many times the others' noise, which carries most of both spreads, widens it as it should
    (tests/harness/test_effect.py measures its coverage). None where a row's removal leaves no spread."""
    n = len(x)
    if n < 3:
        return None
    tx, loo_x = _centred_sums(x @ x.T, g)
    ty, loo_y = _centred_sums(y @ y.T, g)
    scale_x, scale_y = max(tx, 1e-300), max(ty, 1e-300)
    if min(loo_x.min() / scale_x, loo_y.min() / scale_y) <= 1e-12:
        return None
    full = math.log(ty / tx)
    values = np.log(loo_y) - np.log(loo_x)
    e = values - values.mean()
    s2, s4 = float((e * e).sum()), float((e ** 4).sum())
    se = math.sqrt((n - 1) / n * s2)
    dof = min(n - 1.0, max(1.0, 3 * s2 * s2 / s4 - 1)) if s4 > 0 else n - 1.0
    t = float(sps.t.ppf(1 - alpha / 2, dof))
    return [math.exp(full - t * se), math.exp(full + t * se)]


def _units(d: np.ndarray, g: np.ndarray, blocks: Optional[Sequence]) -> tuple[np.ndarray, np.ndarray]:
    """The observations of the bias: the rows' differences, or the mean difference of each block
    (with its group) where every group holds two blocks or more."""
    if blocks is None:
        return d, g
    b = np.asarray([str(v) for v in blocks])
    if len(b) != len(d):
        raise ValueError(f"{len(b)} block labels for {len(d)} rows")
    keys = sorted({(int(gi), bi) for gi, bi in zip(g, b)})
    if min(sum(1 for kg, _ in keys if kg == grp) for grp in set(g.tolist())) < 2:
        return d, g
    means = np.stack([d[(g == kg) & (b == kb)].mean(axis=0) for kg, kb in keys])
    return means, np.asarray([kg for kg, _ in keys])


def _mean_square(d: np.ndarray, g: np.ndarray, alpha: float) -> tuple[float, list[float], float]:
    """``(mean square bias, its interval, d_eff)`` from the observations ``d`` in groups ``g`` (labels 0..G-1):
    ``(sum_g n_g ||mean_g d||^2 - G tr S_d) / n`` and the noncentral-F interval of the module's docstring.
    When the observations are more alike than independent ones would be (``T`` below the central F's
    ``alpha / 2`` quantile: rows drawn without replacement from a small data set), the upper end is unknown (inf)."""
    n, k = len(d), int(g.max()) + 1
    dc, means = _centred(d, g)
    td, ed = _spread(dc, n - k, d)
    shift = float((np.bincount(g) * (means ** 2).sum(axis=1)).sum())  # sum_g n_g ||mean_g d||^2
    ms = max(shift - k * td, 0.0) / n  # the noise's share taken out
    if td == 0:  # the difference does not vary: it is what it is
        return shift / n, [shift / n] * 2, ed
    t, dfn, dfd = (shift / k) / td, k * ed, (n - k) * ed
    if float(sps.f.cdf(t, dfn, dfd)) < alpha / 2:
        return ms, [0.0, math.inf], ed
    lams = [_noncentrality(t, dfn, dfd, p) for p in (1 - alpha / 2, alpha / 2)]
    return ms, [lam * td / (ed * n) for lam in lams], ed


def _in_sd(mean_square: float, variance: float) -> float:
    """``sqrt(mean_square / variance)``: a bias in units of one device's standard deviation."""
    if variance > 0:
        return math.sqrt(mean_square / variance)
    return 0.0 if mean_square == 0 else math.inf
