"""Chi-square goodness of fit with stated power: pooling, the test itself, and the power analysis behind N.

The least favourable shift. For pooled categories with oracle probabilities p and any alternative q at total
variation distance TV(p, q) = d, Cauchy-Schwarz gives

    sum_i (q_i - p_i)^2 / p_i  >=  (sum_i |q_i - p_i|)^2 / sum_i p_i  =  (2 d)^2 = 4 d^2,

with equality when |q_i - p_i| is proportional to p_i, i.e. moving d of mass from a set of categories holding
half the probability to the other half, spread in proportion. The chi-square statistic of N draws from q is then
approximately noncentral chi-square with df = K - 1 and noncentrality lambda = N * sum (q - p)^2 / p >= 4 N d^2;
power increases with lambda, so ncx2(df, 4 N d^2) is the power against the worst alternative at distance d.
(Distance is measured on the pooled categories: a shift inside the pooled tail bin is invisible to this test;
draws outside the support are caught by the exact support check instead.)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy import optimize, stats

MIN_EXPECTED = 5.0  # the usual validity rule for the chi-square approximation


def pool(probs: np.ndarray, n: int) -> np.ndarray:
    """Category index per entry of probs (all > 0): entries expecting >= 5 draws stand alone, the rest share a
    tail bin, and a tail still expecting < 5 joins the smallest standing category."""
    alone = probs * n >= MIN_EXPECTED
    if not alone.any():
        return np.zeros(len(probs), dtype=np.int64)
    bins = np.full(len(probs), -1, dtype=np.int64)
    bins[alone] = np.arange(int(alone.sum()))
    tail = ~alone
    if tail.any():
        tail_bin = int(alone.sum()) if probs[tail].sum() * n >= MIN_EXPECTED else bins[alone][probs[alone].argmin()]
        bins[tail] = tail_bin
    return bins


def num_categories(probs: np.ndarray, n: int) -> int:
    return int(pool(probs, n).max()) + 1


@lru_cache(maxsize=4096)
def required_noncentrality(df: int, alpha: float, power: float) -> float:
    """The lambda at which the level-alpha chi-square test with df degrees of freedom has the given power."""
    crit = stats.chi2.isf(alpha, df)
    hi = 1.0
    while stats.ncx2.sf(crit, df, hi) < power:
        hi *= 2.0
    return float(optimize.brentq(lambda lam: stats.ncx2.sf(crit, df, lam) - power, 0.0, hi, xtol=1e-6))


def power_at(n: int, df: int, alpha: float, tv: float) -> float:
    """Power of N draws against the least favourable alternative at total variation tv."""
    return float(stats.ncx2.sf(stats.chi2.isf(alpha, df), df, 4.0 * n * tv * tv))


def detectable_tv(n: int, df: int, alpha: float, power: float) -> float:
    """The smallest total variation detected with the given power by N draws (in the worst direction)."""
    return float(np.sqrt(required_noncentrality(df, alpha, power) / (4.0 * n)))


def required_draws(probs: np.ndarray, alpha: float, tv: float, power: float) -> int:
    """The smallest N (to the pooling's fixed point) with power >= `power` at distance tv. More draws split more
    categories out of the tail, which raises df and so the noncentrality needed: iterate until N suffices."""
    n = 1
    while True:
        df = max(num_categories(probs, n) - 1, 1)
        need = int(np.ceil(required_noncentrality(df, alpha, power) / (4.0 * tv * tv)))
        if need <= n:
            return n
        n = need


@dataclass(frozen=True)
class FitResult:
    categories: int
    statistic: float
    p_value: float
    pooled_mass: float  # probability of the entries that do not stand alone


def chi_square(counts: np.ndarray, probs: np.ndarray) -> FitResult:
    """Goodness of fit of counts (over the support, one per entry of probs) to probs, after pooling."""
    n = int(counts.sum())
    bins = pool(probs, n)
    k = int(bins.max()) + 1
    observed = np.bincount(bins, weights=counts, minlength=k)
    expected = np.bincount(bins, weights=probs, minlength=k)
    pooled_mass = float(probs[probs * n < MIN_EXPECTED].sum())
    if k < 2:
        return FitResult(k, 0.0, 1.0, pooled_mass)
    res = stats.chisquare(observed, n * expected / expected.sum())
    return FitResult(k, float(res.statistic), float(res.pvalue), pooled_mass)
