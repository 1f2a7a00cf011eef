"""The statistics of an A/B run: the ratio of two revisions' times from paired repeats, its confidence interval and
a verdict at the noise measured.

Repeat i measures both sides back to back, so whatever the host was doing then hits both: the pair's log ratio
log(ref_i / new_i) cancels that drift, and the repeats' log ratios are treated as independent draws. The ratio is
exp(mean), its interval exp(mean +- t(n - 1) x sd / sqrt(n)) (a t-interval on the log scale, so the ratio's
interval is asymmetric as ratios are). ratio > 1: the new revision takes less time than the reference.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

Verdict = str  # "faster", "slower" or "no difference" (the new revision against the reference)


@dataclass(frozen=True)
class PairedRatio:
    ratio: float  # reference time / new time, geometric mean over the pairs
    low: float  # the confidence interval of the ratio
    high: float
    noise: float  # standard deviation of the pairs' log ratios (about the relative noise of one pair)
    n: int
    confidence: float
    verdict: Verdict


def paired_ratio(ref: Sequence[float], new: Sequence[float], confidence: float = 0.95) -> PairedRatio:
    """faster when the whole interval lies above 1, slower when below, else no difference at this noise."""
    from scipy.stats import t

    if len(ref) != len(new) or len(ref) < 2:
        raise ValueError(f"paired repeats needed, at least 2 of each: got {len(ref)} and {len(new)}")
    if min(ref) <= 0 or min(new) <= 0:
        raise ValueError("times must be positive")
    logs = [math.log(r / n) for r, n in zip(ref, new)]
    n, mean, sd = len(logs), statistics.fmean(logs), statistics.stdev(logs)
    half = float(t.ppf((1 + confidence) / 2, n - 1)) * sd / math.sqrt(n)
    low, high = math.exp(mean - half), math.exp(mean + half)
    verdict = "faster" if low > 1 else "slower" if high < 1 else "no difference"
    return PairedRatio(math.exp(mean), low, high, sd, n, confidence, verdict)
