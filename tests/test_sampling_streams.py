"""The draws users get (harness/sampling/streams.py): tokens through Sampler.prepare / sample as the driver calls
them are independent across positions and across requests, and each position's marginal is the oracle's filtered
distribution, at the stated power; planted faults in the uniforms fail."""

from __future__ import annotations

import pytest
import torch

from harness.sampling.streams import POWER, TV_MARGINAL, TV_PAIRS, FaultySampler, run_streams

# the test kind each fault must fail
FAULTS = {"position-blind": "pairs (t, t+1)", "chained": "pairs (t, t+1)", "uid-blind": "two requests at t",
          "skewed": "marginal at position"}


def _check_power(result) -> None:
    for t in result.tests:
        target = TV_MARGINAL if t.kind.startswith("marginal") else TV_PAIRS
        assert t.detectable_tv <= target, f"{t.case}: {t.kind} detects only {t.detectable_tv:.3f} at power {POWER}"


def test_the_engines_draws_are_independent_draws_from_the_filtered_distribution() -> None:
    result = run_streams("cpu")
    assert result.passed, result.failed()
    _check_power(result)


@pytest.mark.parametrize("fault, must_fail", FAULTS.items())
def test_a_planted_fault_in_the_uniforms_fails(fault: str, must_fail: str) -> None:
    result = run_streams("cpu", sampler=FaultySampler(torch.device("cpu"), 6, fault=fault))  # type: ignore[arg-type]
    assert not result.passed
    assert any(must_fail in line for line in result.failed()), result.failed()


@pytest.mark.cuda
def test_the_engines_draws_on_cuda() -> None:
    """The same draws through FlashInfer's filters."""
    result = run_streams("cuda")
    assert result.passed, result.failed()
    _check_power(result)
