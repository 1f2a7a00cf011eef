"""The draws users get: tokens sampled through Sampler.prepare / sample as the driver calls them, over many requests
and positions, tested for independence and for their marginals with stated power.

A run builds many requests per case (half with a seed of their own, half on the sampler's stream, prompts of a few
lengths) and steps them as the driver does: one prepare per step on a Batch of Req (prefill first, then decodes,
the rows in a new order every step as continuous batching moves them), forward_batch's complete_one, one sample.
Every request sees the same logits at every position, so under a correct sampler its tokens are independent draws
from the oracle's filtered distribution p. Per case, chi-square goodness of fit (harness.sampling.stats) of:
- each position's tokens across requests against p (the marginal at every position);
- pairs (token at t, token at t + 1) of each request, t even and t odd (disjoint pairs), against p x p;
- pairs of two requests at the same position (disjoint pairs of requests, both seeded or both on the sampler's
  stream) against p x p.
The number of requests comes from the power analysis: each position's marginal detects a total variation of
TV_MARGINAL and every pair test one of TV_PAIRS (in the least favourable direction) with power POWER at the
Bonferroni-corrected level. FaultySampler plants faults in the uniforms that these tests must reject.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Dict, List, Literal, Sequence

import numpy as np
import torch

from engine.core import Batch, Req, SamplingParams
from engine.sample import BatchSamplingArgs, Sampler
from harness.sampling.oracle import filtered_distribution
from harness.sampling.stats import chi_square, detectable_tv, required_draws

LOGITS = np.array([2.0, 1.2, 0.7, 0.0, -0.5, -1.5])
CASES: Dict[str, SamplingParams] = {
    "temperature 1": SamplingParams(temperature=1.0),
    "top-k 3, temperature 0.8": SamplingParams(temperature=0.8, top_k=3),
    "top-p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
    "min-p 0.1, temperature 1.2": SamplingParams(temperature=1.2, min_p=0.1),
}
POSITIONS = 16
TV_MARGINAL, TV_PAIRS, POWER, FAMILY_ALPHA = 0.1, 0.05, 0.99, 0.01

StreamFault = Literal["position-blind", "chained", "uid-blind", "skewed"]
_WEYL = (math.sqrt(5.0) - 1.0) / 2.0


@dataclass
class FaultySampler(Sampler):
    """The engine's sampler with a planted fault in its uniforms, for showing that the stream tests fail:
    position-blind: a request's key leaves out the position, so it reads one uniform at every position;
    chained: u(t + 1) = frac(u(t) + 0.618...): every uniform is uniform, each a function of the one before;
    uid-blind: requests without a seed of their own leave their uid out of the key, so they share one stream;
    skewed: u is squared (independent draws, wrong marginals)."""

    fault: StreamFault = "position-blind"
    _last: Dict[int, float] = field(default_factory=dict)

    def _key(self, params: SamplingParams, uid: int, position: int) -> tuple[int, int, int, int]:
        if self.fault == "position-blind":
            position = 0
        if self.fault == "uid-blind" and params.seed is None:
            uid = 0
        return super()._key(params, uid, position)

    def prepare(self, batch: Batch) -> BatchSamplingArgs:
        args = super().prepare(batch)
        if self.fault in ("chained", "skewed") and args.uniforms is not None:
            u = args.uniforms.cpu().numpy()
            if self.fault == "skewed":
                u = u * u
            for i, r in enumerate(batch.reqs):
                if self.fault == "chained" and r.uid in self._last:
                    u[i] = (self._last[r.uid] + _WEYL) % 1.0
                self._last[r.uid] = float(u[i])
            args.uniforms = torch.from_numpy(u).to(args.uniforms.device)
        return args


@dataclass(frozen=True)
class StreamTest:
    case: str
    kind: str  # "marginal at position t", "pairs (t, t+1), t even", "pairs (t, t+1), t odd", "two requests at t"
    n: int
    categories: int
    statistic: float
    p_value: float
    alpha: float
    detectable_tv: float  # detected with power POWER (least favourable direction)
    outside: int  # draws (or pairs) outside the oracle's support

    @property
    def passed(self) -> bool:
        return self.outside == 0 and self.p_value >= self.alpha


@dataclass
class StreamResult:
    tests: List[StreamTest]
    requests: Dict[str, int]  # per case
    positions: int

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.tests)

    def failed(self) -> List[str]:
        return [f"{t.case}: {t.kind} (p {t.p_value:.1e} < alpha {t.alpha:.1e}, {t.outside} outside)"
                for t in self.tests if not t.passed]


def _oracle(params: SamplingParams) -> np.ndarray:
    f = filtered_distribution(LOGITS, params.temperature, params.top_k, params.top_p, params.min_p)
    assert f.probs is not None and f.margin > 1e-3, "a case's thresholds must be clear of float32 rounding"
    return f.probs


def requests_needed(probs: np.ndarray, positions: int, alpha: float) -> int:
    """Requests per case so that each position's marginal and the sparsest pair test (t odd: (positions - 1) // 2
    pairs a request) reach their target total variation with power POWER at level alpha (even: pairs of requests)."""
    p = probs[probs > 0]
    marginal = required_draws(p, alpha, TV_MARGINAL, POWER)
    pairs = required_draws(np.outer(p, p).ravel(), alpha, TV_PAIRS, POWER)
    n = max(marginal, -(-pairs // ((positions - 1) // 2)), -(-2 * pairs // positions))
    return n + n % 2


def draw_streams(sampler: Sampler, cases: Dict[str, int], positions: int) -> Dict[str, np.ndarray]:
    """cases: name -> number of requests. Step every request through `positions` tokens in one batch, as the
    driver does -> per case int64 [requests, positions]. Requests 2m and 2m + 1 share a prompt length and a kind:
    pairs m even have seeds of their own (all distinct), pairs m odd draw from the sampler's seed and their uid."""
    reqs, owner = [], []
    for name, count in cases.items():
        for i in range(count):
            uid, pair = len(reqs), i // 2
            params = replace(CASES[name], max_tokens=positions, seed=1000 + uid if pair % 2 == 0 else None)
            reqs.append(Req(input_ids=torch.zeros(1 + pair % 3, dtype=torch.int32), table_idx=uid, cached_len=0,
                            output_len=positions, uid=uid, sampling_params=params, cache_handle=None))
            owner.append(name)
    logits = torch.from_numpy(LOGITS).float().to(sampler.device).expand(len(reqs), -1).contiguous()
    tokens = np.zeros((len(reqs), positions), dtype=np.int64)
    rng = np.random.default_rng(0)
    for t in range(positions):
        order = rng.permutation(len(reqs))  # rows move between steps: a request's tokens must not follow its row
        batch = Batch([reqs[i] for i in order], "prefill" if t == 0 else "decode")
        args = sampler.prepare(batch)
        for r in batch.reqs:  # what forward_batch does before it samples
            r.complete_one()
        tokens[order, t] = sampler.sample(logits, args).cpu().numpy()
    names = np.array(owner)
    return {name: tokens[names == name] for name in cases}


def _fit(case: str, kind: str, draws: np.ndarray, probs: np.ndarray, alpha: float) -> StreamTest:
    support = np.flatnonzero(probs > 0)
    counts = np.bincount(draws + 1, minlength=len(probs) + 1)[1:]  # draws: category ids, -1 for an invalid token
    outside = len(draws) - int(counts[support].sum())
    fit = chi_square(counts[support], probs[support])
    return StreamTest(case, kind, len(draws), fit.categories, fit.statistic, fit.p_value, alpha,
                      detectable_tv(len(draws), max(fit.categories - 1, 1), alpha, POWER), outside)


def stream_tests(case: str, tokens: np.ndarray, probs: np.ndarray, alpha: float) -> List[StreamTest]:
    """tokens [requests, positions] of one case -> its marginal, serial-pair and cross-request tests."""
    vocab, positions = len(probs), tokens.shape[1]
    joint = np.outer(probs, probs).ravel()
    bad = (tokens < 0) | (tokens >= vocab)
    code = np.where(bad, -1, tokens)
    tests = [_fit(case, f"marginal at position {t}", code[:, t], probs, alpha) for t in range(positions)]
    for start, label in ((0, "even"), (1, "odd")):
        a, b = code[:, start:positions - 1:2], code[:, start + 1:positions:2]
        pairs = np.where((a < 0) | (b < 0), -1, a * vocab + b).ravel()
        tests.append(_fit(case, f"pairs (t, t+1), t {label}", pairs, joint, alpha))
    a, b = code[0::2], code[1::2]
    pairs = np.where((a < 0) | (b < 0), -1, a * vocab + b).ravel()
    tests.append(_fit(case, "two requests at t", pairs, joint, alpha))
    return tests


def run_streams(device: str = "cpu", sampler: Sampler | None = None, positions: int = POSITIONS,
                cases: Sequence[str] = tuple(CASES)) -> StreamResult:
    """Draw and test every case; sampler replaces the engine's (a FaultySampler, to plant a fault)."""
    sampler = sampler or Sampler(torch.device(device), len(LOGITS))
    alpha = FAMILY_ALPHA / (len(cases) * (positions + 3))
    probs = {name: _oracle(CASES[name]) for name in cases}
    counts = {name: requests_needed(probs[name], positions, alpha) for name in cases}
    tokens = draw_streams(sampler, counts, positions)
    tests = [t for name in cases for t in stream_tests(name, tokens[name], probs[name], alpha)]
    return StreamResult(tests, counts, positions)
