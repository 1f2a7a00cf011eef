"""The smallest fault size a check detects: bisection in log space between e_min and e_max.

Detection is assumed monotone in e (a larger fault of the same family is caught whenever a smaller one is), which
the search checks at the ends: e_max must be detected and e_min missed, or the search stops and says which end
failed. Between them each probe halves the bracket's log-width until largest missed / smallest detected <= ratio,
so a range of R takes about log2(ln R / ln ratio) probes besides the two ends.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, List, Literal


@dataclass(frozen=True)
class Verdict:
    detected: bool
    detail: str = ""  # what the check saw: the statistic that crossed its limit, or the closest one


@dataclass
class Probe:
    e: float
    detected: bool
    seconds: float
    detail: str


Status = Literal["bracketed", "detected at e_min", "missed at e_max"]


@dataclass
class Search:
    e_min: float
    e_max: float
    ratio: float
    status: Status = "bracketed"
    probes: List[Probe] = field(default_factory=list)

    @property
    def smallest_detected(self) -> float | None:
        return min((p.e for p in self.probes if p.detected), default=None)

    @property
    def largest_missed(self) -> float | None:
        return max((p.e for p in self.probes if not p.detected), default=None)

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.probes)


def find_threshold(check: Callable[[float], Verdict], e_min: float, e_max: float, ratio: float = 1.25) -> Search:
    """Bisect check (fault size -> Verdict) in log space between e_min and e_max (0 < e_min < e_max, ratio > 1)."""
    if not 0.0 < e_min < e_max or ratio <= 1.0:
        raise ValueError(f"need 0 < e_min < e_max and ratio > 1, got e_min={e_min}, e_max={e_max}, ratio={ratio}")
    search = Search(e_min, e_max, ratio)

    def probe(e: float) -> bool:
        start = time.perf_counter()
        verdict = check(e)
        search.probes.append(Probe(e, verdict.detected, time.perf_counter() - start, verdict.detail))
        return verdict.detected

    if not probe(e_max):
        search.status = "missed at e_max"
        return search
    if probe(e_min):
        search.status = "detected at e_min"
        return search
    lo, hi = e_min, e_max
    while hi / lo > ratio:
        mid = math.sqrt(lo * hi)
        if probe(mid):
            hi = mid
        else:
            lo = mid
    return search
