"""The PDL timeline probe (harness/bench/pdl_timeline.py): on the GPU, a call launched under programmatic dependent
launch is released from its wait no sooner than the call before it ends, by the GPU's own clock (what every PDL kernel
of the engine relies on to read its input only after the wait), and the same check sees calls overlap once the wait
is taken out; without an sm90 GPU the command says what it needs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from harness.bench import pdl_timeline as pt

sm90 = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9,
                          reason="programmatic dependent launch needs sm90 or later")


@pytest.mark.cuda
@sm90
@pytest.mark.parametrize("variant", ["W, wait, x (the skinny GEMM's order)", "no W, wait, x"])
def test_a_call_is_released_no_sooner_than_the_call_before_it_ends(variant):
    r = pt.timeline(variant, calls=16)
    assert r["most_calls_in_flight"] >= 1 and r["us_a_call"] > 0
    assert r["min_release_after_previous_end_us"] >= 0, r


@pytest.mark.cuda
@sm90
def test_without_the_wait_a_call_runs_before_the_call_before_it_ends():
    """The planted fault: the same chain, nothing waiting; the check above must see it."""
    r = pt.timeline("W, no wait, x (unordered)", calls=16)
    assert r["min_release_after_previous_end_us"] < 0, r
    assert r["most_calls_in_flight"] >= 2, r


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a machine without a GPU")
def test_says_it_needs_a_gpu():
    out = subprocess.run([sys.executable, "-m", "harness.bench.pdl_timeline"], capture_output=True, text=True)
    assert out.returncode != 0 and "needs a CUDA GPU of sm90" in out.stderr
