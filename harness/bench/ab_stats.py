"""The statistics of an A/B run: the ratio of two revisions' times from paired repeats, its confidence interval and
a verdict at the noise measured.

Repeat i measures both sides back to back, so whatever the host was doing then hits both: the pair's log ratio
log(ref_i / new_i) cancels that drift. The ratio is exp(mean), its interval exp(mean +- t(n - 1) x sd / sqrt(n)) (a
t-interval on the log scale, so the ratio's interval is asymmetric as ratios are). ratio > 1: the new revision takes
less time than the reference.

The pairs of one pair of processes are not independent draws: a process keeps a speed of its own for its whole life
(where its memory landed, which core it got). Measured on a 2-core CPU host, one tree against itself, 12 pairs in
each of three process pairs: 95% intervals of 1.076 [1.042, 1.110] and 0.978 [0.961, 0.996] among six rows, two false
verdicts. So a run measures several rounds, each a fresh pair of processes, and the interval comes from the rounds'
mean log ratios (rounds_ratio: t with rounds - 1 degrees of freedom), which carry that bias as the noise it is.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

Verdict = str  # "faster", "slower" or "no difference" (the new revision against the reference)


@dataclass(frozen=True)
class PairedRatio:
    ratio: float  # reference time / new time: exp of the mean log ratio (over the pairs, or the rounds' means)
    low: float  # the confidence interval of the ratio
    high: float
    noise: float  # standard deviation of those log ratios (about the relative noise of one pair, or one round)
    n: int  # pairs, or rounds
    confidence: float
    verdict: Verdict


def paired_ratio(ref: Sequence[float], new: Sequence[float], confidence: float = 0.95) -> PairedRatio:
    """faster when the whole interval lies above 1, slower when below, else no difference at this noise."""
    if len(ref) != len(new) or len(ref) < 2:
        raise ValueError(f"paired repeats needed, at least 2 of each: got {len(ref)} and {len(new)}")
    if min(ref) <= 0 or min(new) <= 0:
        raise ValueError("times must be positive")
    return _log_ratio_interval([math.log(r / n) for r, n in zip(ref, new)], confidence)


def rounds_ratio(ref_rounds: Sequence[Sequence[float]], new_rounds: Sequence[Sequence[float]],
                 confidence: float = 0.95) -> PairedRatio:
    """The ratio over rounds of paired repeats, each round a fresh pair of processes: the mean over rounds of each
    round's mean log ratio, its t-interval over the rounds; noise is the standard deviation of a round's mean. One
    round: paired_ratio over its pairs, an interval that leaves the processes' own bias out."""
    if len(ref_rounds) != len(new_rounds) or not ref_rounds:
        raise ValueError(f"the same rounds on both sides needed: got {len(ref_rounds)} and {len(new_rounds)}")
    if len(ref_rounds) == 1:
        return paired_ratio(ref_rounds[0], new_rounds[0], confidence)
    means = []
    for ref, new in zip(ref_rounds, new_rounds):
        if len(ref) != len(new) or not ref or min(ref) <= 0 or min(new) <= 0:
            raise ValueError("each round needs paired, positive times")
        means.append(statistics.fmean(math.log(r / n) for r, n in zip(ref, new)))
    return _log_ratio_interval(means, confidence)


def _log_ratio_interval(logs: Sequence[float], confidence: float) -> PairedRatio:
    """exp(mean) of independent log ratios with its t-interval and the verdict it gives."""
    sd = statistics.stdev(logs)  # at least two: one log ratio has no interval
    mean, low, high = (math.exp(x) for x in mean_interval(logs, confidence))
    verdict = "faster" if low > 1 else "slower" if high < 1 else "no difference"
    return PairedRatio(mean, low, high, sd, len(logs), confidence, verdict)


def threshold_ratio(pct: float) -> float:
    """The ratio (reference time / new time) of a new revision exactly pct percent slower."""
    return 1.0 / (1.0 + pct / 100.0)


def slower_beyond(high: float, pct: float) -> bool:
    """The performance gate (bench --against --fail-if-slower pct): whether a row's ratio interval, whose upper end
    is high, lies wholly beyond pct percent slower, so that even the interval's most favourable reading has the new
    revision more than pct percent slower. An interval that reaches the threshold passes: the run cannot tell."""
    return high < threshold_ratio(pct)


def mean_interval(xs: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the repeats' mean with its t-interval; one repeat, or a repeat that is not finite (a rate
    over a run too short for the clock), has no interval (nan)."""
    from scipy.stats import t

    mean = statistics.fmean(xs)
    if len(xs) < 2 or not all(math.isfinite(x) for x in xs):
        return mean, math.nan, math.nan
    half = float(t.ppf((1 + confidence) / 2, len(xs) - 1)) * statistics.stdev(xs) / math.sqrt(len(xs))
    return mean, mean - half, mean + half
