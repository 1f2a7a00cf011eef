"""The sampler's Triton kernels (engine/kernels/sample_kernel.py), searched by hypothesis over rows, vocabularies
(within one block, at its edges, several blocks), logits (spread, ties, masked -inf ids, bad rows), temperatures (a
greedy row's 1e-6 too) and uniforms; on the CPU through Triton's interpreter. The draw against the inverse CDF of the
float64 softmax of the float32 tempered logits (sample.py's float64 reference; torch's float32 softmax flushes to zero
the ids more than about 104 below the max, which the kernel's weights relative to each block's own max may keep, so a
point of exactly 0 can fall on one of them): each drawn id's CDF interval [cdf[k - 1], cdf[k]) holds the point within
1e-6 of the row's mass (probabilities rounded in float32 and summed in another order differ by a few units of 1e-7), and
it has mass. The check itself fails a draw planted one id off or read 0.1% of the mass low. The argmax against torch's,
and both kernels' answer to a bad row (-1) against sample.py's rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core import SamplingParams
from engine.sample import Sampler
from engine.utils.device import has_triton
from harness.sampling.run import make_batch

pytestmark = [pytest.mark.skipif(not has_triton(), reason="needs Triton"), pytest.mark.devices]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SLACK = 1e-6


@st.composite
def _rows(draw):
    from engine.kernels.sample_kernel import BLOCK

    rows = draw(st.integers(1, 4))
    vocab = draw(st.sampled_from([6, 100, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 808]))
    seed = draw(st.integers(0, 2 ** 16))
    gen = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([0.1, 1.0, 5.0, 30.0]))
    logits = torch.randn(rows, vocab, generator=gen) * scale
    if draw(st.booleans()):  # ties: logits rounded to a coarse grid
        logits = logits.round()
    if draw(st.booleans()):  # masked ids (a filter's -inf), never the whole row
        logits[torch.rand(rows, vocab, generator=gen) < 0.5] = float("-inf")
        logits[:, 0] = 0.0
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    temps = torch.tensor(draw(st.lists(st.sampled_from([1e-6, 0.6, 1.0, 2.0]), min_size=rows, max_size=rows)))
    uniforms = torch.tensor(draw(st.lists(st.floats(0.0, 1.0, exclude_max=True), min_size=rows, max_size=rows)),
                            dtype=torch.float64)
    return logits.to(dtype), temps, uniforms


def _assert_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor, got: torch.Tensor) -> None:
    cdf = probs.double().cumsum(-1)
    for row, k in enumerate(got.tolist()):
        total = cdf[row, -1].item()
        point, slack = uniforms[row].item() * total, SLACK * total
        lo = cdf[row, k - 1].item() if k else 0.0
        assert 0 <= k < probs.shape[1] and probs[row, k] > 0, (row, k)
        assert lo - slack <= point < cdf[row, k].item() + slack, (row, k, lo, point, cdf[row, k].item())


@settings(max_examples=60, deadline=None)
@given(case=_rows())
def test_tempered_draw_is_torchs_inverse_cdf(case):
    from engine.kernels.sample_kernel import draw

    logits, temps, uniforms = case
    got = draw(logits.to(DEVICE), uniforms.to(DEVICE), temps.to(DEVICE)).cpu()
    _assert_inverse_cdf(torch.softmax((logits.float() / temps.unsqueeze(1)).double(), -1), uniforms, got)


@settings(max_examples=40, deadline=None)
@given(case=_rows())
def test_draw_from_given_probabilities_is_torchs_inverse_cdf(case):
    """Unnormalized probabilities with zeros (a filter's output): the same search, no softmax."""
    from engine.kernels.sample_kernel import draw

    logits, temps, uniforms = case
    probs = torch.softmax(logits.float() / temps.unsqueeze(1), -1)
    probs = torch.where(probs >= probs.amax(-1, keepdim=True) * 0.01, probs, 0.0)
    got = draw(probs.to(DEVICE), uniforms.to(DEVICE)).cpu()
    _assert_inverse_cdf(probs, uniforms, got)


@pytest.mark.parametrize("fault", ["the next id", "the point x 0.999"])
def test_the_check_catches_a_draw_off_by_one_id_or_a_thousandth_of_the_mass(fault):
    """The check above against draws planted wrong: the id after the right one, or the inverse CDF read 0.1% low
    (16 rows of 9000 ids at spread 1: every id's interval is far narrower than 0.1% of the mass)."""
    from engine.sample import inverse_cdf

    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(16, 9000, generator=gen), -1)
    uniforms = torch.rand(16, dtype=torch.float64, generator=gen) * 0.9 + 0.05
    right = inverse_cdf(probs, uniforms)
    _assert_inverse_cdf(probs, uniforms, right)
    wrong = right + 1 if fault == "the next id" else inverse_cdf(probs, uniforms * 0.999)
    with pytest.raises(AssertionError):
        _assert_inverse_cdf(probs, uniforms, wrong)


@st.composite
def _rows_with_bad(draw):
    """Rows of _rows with some replaced by bad ones: a NaN, a +inf or a -inf id, all -inf, finite but huge."""
    logits, temps, uniforms = draw(_rows())
    logits = logits.float()
    kinds = draw(st.lists(st.sampled_from(["good", "nan", "+inf", "-inf id", "all -inf", "huge"]),
                          min_size=len(logits), max_size=len(logits)))
    for row, kind in enumerate(kinds):
        at = draw(st.integers(0, logits.shape[1] - 1))
        if kind in ("nan", "+inf", "-inf id"):
            logits[row, at] = {"nan": float("nan"), "+inf": float("inf"), "-inf id": float("-inf")}[kind]
        elif kind == "all -inf":
            logits[row] = float("-inf")
        elif kind == "huge":
            logits[row, at] = 3e38
    return logits.to(draw(st.sampled_from([torch.float32, torch.bfloat16]))), temps, uniforms


def _valid(logits: torch.Tensor) -> torch.Tensor:
    """sample.py's rule: a row is drawn from iff its max is finite (amax propagates NaN)."""
    return torch.isfinite(logits.float().amax(-1))


@settings(max_examples=60, deadline=None)
@given(case=_rows_with_bad())
def test_argmax_is_the_lowest_maximal_id_and_minus_one_for_a_bad_row(case):
    from engine.kernels.sample_kernel import argmax

    logits, _, _ = case
    got = argmax(logits.to(DEVICE)).cpu()
    want = torch.where(_valid(logits), logits.float().argmax(-1), -1)  # torch's argmax: the first maximal id
    assert torch.equal(got, want), (got, want)


@settings(max_examples=60, deadline=None)
@given(case=_rows_with_bad())
def test_tempered_draw_gives_minus_one_for_a_bad_row_and_leaves_the_others_alone(case):
    """Each row is its own program: a bad row's neighbours draw what they draw alone."""
    from engine.kernels.sample_kernel import draw

    logits, temps, uniforms = case
    valid = _valid(logits)
    got = draw(logits.to(DEVICE), uniforms.to(DEVICE), temps.to(DEVICE)).cpu()
    assert torch.equal(got < 0, ~valid), (got, valid)
    for row in torch.nonzero(valid).flatten().tolist():
        alone = draw(logits[row: row + 1].to(DEVICE), uniforms[row: row + 1].to(DEVICE),
                     temps[row: row + 1].to(DEVICE)).cpu()
        assert got[row] == alone[0]


@pytest.mark.parametrize("mode", ["greedy", "sampled", "mixed"])
def test_sampler_on_this_device_gives_minus_one_for_bad_rows_only(mode):
    """Sampler.sample on the device the tests run on (CUDA: the kernels above; the CPU: torch): a NaN, +inf or
    all -inf row gets -1, a row with a -inf id is drawn from, and the good rows get what they get without the bad."""
    gen = torch.Generator().manual_seed(1)
    good = torch.randn(6, 3000, generator=gen) * 3
    bad = good.clone()
    bad[1, 7], bad[2, 2999], bad[3] = float("nan"), float("inf"), float("-inf")
    bad[4, 0] = float("-inf")
    temps = {"greedy": [0.0] * 6, "sampled": [0.6] * 6, "mixed": [0.0, 0.6, 0.0, 0.6, 0.0, 1.0]}[mode]
    params = [SamplingParams(t) for t in temps]
    sampler = Sampler(torch.device(DEVICE), good.shape[1], seed=5)
    with_bad = sampler.sample(bad.to(DEVICE), sampler.prepare(make_batch(params))).cpu()
    without = sampler.sample(good.to(DEVICE), sampler.prepare(make_batch(params))).cpu()
    assert with_bad[1:4].tolist() == [-1, -1, -1]
    assert torch.equal(with_bad[[0, 5]], without[[0, 5]])
    assert with_bad[4] >= 0


@pytest.mark.parametrize("given", [False, True])
@pytest.mark.parametrize("edge", ["top", "bottom"])
def test_a_point_at_either_end_of_the_mass_draws_an_id_of_mass(given, edge):
    """u the largest double below 1 (or 0) on rows whose last (first) ids are masked: the block's scan sums in
    another order than its mass did, and a point within a rounding of the block's end must still land on an id of
    mass, never on a masked one (the kernel that counted the scan's ids at or below the point drew the last, masked
    id on 25-28 of these 48 rows, from logits and from probabilities alike, in Triton's interpreter)."""
    from engine.kernels.sample_kernel import draw

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(48, 8191, generator=gen) * 3
    masked = slice(-50, None) if edge == "top" else slice(0, 50)
    logits[:, masked] = float("-inf")
    temps = torch.full((48,), 0.6)
    u = torch.full((48,), float(np.nextafter(1.0, 0.0)) if edge == "top" else 0.0, dtype=torch.float64)
    probs = torch.softmax((logits / temps.unsqueeze(1)).double(), -1)
    got = (draw(probs.float().to(DEVICE), u.to(DEVICE)) if given else
           draw(logits.to(DEVICE), u.to(DEVICE), temps.to(DEVICE))).cpu()
    assert all(probs[row, k] > 0 for row, k in enumerate(got.tolist())), got
