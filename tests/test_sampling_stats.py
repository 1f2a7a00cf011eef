"""The distribution tests themselves: the power analysis holds up, the grid passes the sampler, and it has teeth.

Teeth: five samplers with a planted fault each must fail the grid. They run at a target distance of 0.05
instead of 0.01 (N about 25 times smaller, so the five runs take seconds); test_faults_move_a_row_by_at_least
checks that each fault moves some row by at least that distance (or off the support), so each is caught with
power >= 0.99 by construction.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable
from unittest import mock

import numpy as np
import pytest
import torch

import engine.sample
from engine.sample import Sampler
from harness.__main__ import main
from harness.sampling.cases import real_cases, small_cases
from harness.sampling.oracle import filtered_distribution
from harness.sampling.run import SampleFn, make_batch, run_grid
from harness.sampling.stats import chi_square, pool, power_at, required_draws

FAULT_TV = 0.05
FAULTS = {  # fault -> a case it must fail
    "top-p-first": "top-k+top-p",
    "no-renormalize": "top-k+top-p",
    "crossing-dropped": "top-p",
    "temperature-twice": "temperature",
    "ties-by-order": "tie-top-k",  # exactly k tokens, the lower ids first: the rule before ties were kept
}


# ------------------------------------------------------------------------------------------ statistics
def test_pool_merges_small_expected_counts() -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.03, 0.02])
    assert pool(probs, 100).tolist() == [0, 1, 2, 3, 3]  # 3 and 2 expected: pooled, the pool expects 5
    assert pool(probs, 60).tolist() == [0, 1, 2, 2, 2]  # a pool expecting 3 joins the smallest category
    assert pool(probs, 1000).tolist() == [0, 1, 2, 3, 4]


def test_least_favourable_shift_is_four_tv_squared() -> None:
    rng = np.random.default_rng(0)
    p = np.array([0.25, 0.25, 0.2, 0.15, 0.1, 0.05])
    for _ in range(200):  # any shift of total variation d has chi-square distance >= 4 d^2
        d = rng.normal(size=p.size) * p
        d -= p * d.sum()
        q = p + 0.01 * d / (0.5 * np.abs(d).sum())
        assert ((q - p) ** 2 / p).sum() >= 4 * 0.01 ** 2 * (1 - 1e-12)
    assert ((worst_shift(p, 0.01) - p) ** 2 / p).sum() == pytest.approx(4 * 0.01 ** 2)


def worst_shift(p: np.ndarray, tv: float) -> np.ndarray:
    """Move tv of mass from the second half of p (by mass) to the first, in proportion: the bound's equality."""
    first = np.cumsum(p) <= 0.5 + 1e-12
    assert p[first].sum() == pytest.approx(0.5)
    return p + np.where(first, 2 * tv * p, -2 * tv * p)


def test_stated_power_holds_in_simulation() -> None:
    """Draw counts from the least favourable alternative at the N the analysis asks for: it rejects >= 99%."""
    rng = np.random.default_rng(1)
    p, alpha, tv = np.array([0.25, 0.25, 0.2, 0.15, 0.1, 0.05]), 0.01, 0.03
    n = required_draws(p, alpha, tv, 0.99)
    assert power_at(n, p.size - 1, alpha, tv) >= 0.99 > power_at(int(0.9 * n), p.size - 1, alpha, tv)
    alt = rng.multinomial(n, worst_shift(p, tv), size=2000)
    null = rng.multinomial(n, p, size=2000)
    rejected = np.mean([chi_square(c, p).p_value < alpha for c in alt])
    false_alarms = np.mean([chi_square(c, p).p_value < alpha for c in null])
    assert rejected >= 0.98 and false_alarms <= 0.02  # 0.99 and 0.01, give or take 3 standard errors


# ------------------------------------------------------------------------------------------ the grid
def test_cli_small_grid_passes_with_full_power(tmp_path: Path) -> None:
    assert main(["sampling", "--no-real", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "sampling.json").read_text())
    assert data["passed"] and data["settings"]["per_test_alpha"] == pytest.approx(0.01 / data["settings"]["tests"])
    sampled = [r for r in data["rows"] if r["kind"] == "sampled"]
    assert len(sampled) == data["settings"]["tests"]
    assert min(r["power_at_tv"] for r in sampled) >= 0.99
    assert "Sampler distribution tests: PASS" in (tmp_path / "sampling.md").read_text()


def test_real_logits_at_low_power() -> None:
    """The 49152-token cases on the engine's SmolLM2 logits, 500 draws a row (the CLI runs ~5000)."""
    result = run_grid("cpu", cases=real_cases(), max_cost=500 * 49152)
    assert result.passed, [r for r in result.rows if not r.passed]
    assert {r.n for r in result.rows} == {500}


@pytest.mark.cuda
def test_small_grid_on_cuda() -> None:
    result = run_grid("cuda", cases=small_cases())
    assert result.passed, [r for r in result.rows if not r.passed]


# ------------------------------------------------------------------------------------------ teeth
def faulty_filtered_probs(fault: str) -> Callable[..., torch.Tensor]:
    """engine.sample.filtered_probs with one planted fault (written by rank, as a sort-based sampler would be)."""

    def probs_fn(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None, min_p: torch.Tensor | None = None) -> torch.Tensor:
        t = temperatures.unsqueeze(1)
        probs = torch.softmax(logits / t / t if fault == "temperature-twice" else logits / t, dim=-1)
        sorted_probs, idx = probs.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(probs.shape[1]).unsqueeze(0)

        def cut_k(sp: torch.Tensor) -> torch.Tensor:
            if top_k is None:
                return sp
            kth = sp.gather(1, (top_k.long() - 1).unsqueeze(1))
            drop = rank >= top_k.unsqueeze(1) if fault == "ties-by-order" else sp < kth
            return sp.masked_fill(drop, 0.0)

        def cut_p(sp: torch.Tensor) -> torch.Tensor:
            if top_p is None:
                return sp
            if fault != "no-renormalize":
                sp = sp / sp.sum(dim=-1, keepdim=True)
            mass = sp.cumsum(dim=-1) if fault == "crossing-dropped" else sp.cumsum(dim=-1) - sp
            drop = mass >= top_p.unsqueeze(1)
            if fault not in ("ties-by-order", "crossing-dropped"):  # the whole tie block of the last kept token stays
                last = (~drop).sum(dim=-1, keepdim=True) - 1
                drop &= sp < sp.gather(1, last)
            return sp.masked_fill(drop, 0.0)

        sorted_probs = cut_k(cut_p(sorted_probs)) if fault == "top-p-first" else cut_p(cut_k(sorted_probs))
        probs = torch.zeros_like(probs).scatter_(1, idx, sorted_probs)
        if min_p is not None:
            probs = probs * (probs >= probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1))
        return probs

    return probs_fn


def faulty_sample_fn(fault: str) -> SampleFn:
    """Sampler.sample with the planted fault in its filter; everything else (greedy rows, bad rows) unchanged."""
    probs_fn = faulty_filtered_probs(fault)

    def sample(logits: torch.Tensor, args: engine.sample.BatchSamplingArgs) -> torch.Tensor:
        with mock.patch.object(engine.sample, "filtered_probs", probs_fn):
            return Sampler(logits.device, logits.shape[1]).sample(logits, args)

    return sample


@pytest.mark.parametrize("fault", FAULTS)
def test_faults_move_a_row_by_at_least(fault: str) -> None:
    worst = 0.0
    for case in small_cases():
        sampler = Sampler(torch.device("cpu"), case.vocab)
        args = sampler.prepare(make_batch(case.params))
        if args.temperatures is None:
            continue
        logits = torch.from_numpy(case.logits)
        logits = torch.where(logits.amax(dim=-1, keepdim=True).isfinite(), logits, 0.0)  # as Sampler.sample does
        got = faulty_filtered_probs(fault)(logits, args.temperatures, args.top_k, args.top_p, args.min_p).double()
        for i, p in enumerate(case.params):
            want = filtered_distribution(case.logits[i], p.temperature, p.top_k, p.top_p, p.min_p).probs
            if want is not None and not p.is_greedy and got[i].sum() > 0:
                worst = max(worst, 0.5 * np.abs(got[i].numpy() / got[i].sum().item() - want).sum())
    assert worst >= FAULT_TV


def test_correct_sampler_passes_in_fault_mode() -> None:
    assert run_grid("cpu", cases=small_cases(), tv=FAULT_TV).passed


@pytest.mark.parametrize("fault, must_fail", FAULTS.items())
def test_planted_fault_fails_the_grid(fault: str, must_fail: str) -> None:
    result = run_grid("cpu", sample_fn=faulty_sample_fn(fault), cases=small_cases(), tv=FAULT_TV)
    assert not result.passed
    assert must_fail in result.failed_cases(), result.failed_cases()
