"""The sampler's Triton draw (engine/sample_kernel.py) against torch's (sample.py: softmax in float32, float64
cumsum, searchsorted), searched by hypothesis over rows, vocabularies (within one block, at its edges, several
blocks), logits (spread, ties, masked -inf ids), temperatures (a greedy row's 1e-6 too) and uniforms; on the CPU
through Triton's interpreter. Each drawn id is torch's inverse CDF at the row's point up to rounding: its CDF interval
[cdf[k - 1], cdf[k]) holds the point within 1e-6 of the row's mass (float32 probabilities summed in another order
differ by a few units of 1e-7), and it has mass. The check itself fails a draw planted one id off or read 0.1% of
the mass low."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.utils.device import has_triton

pytestmark = [pytest.mark.skipif(not has_triton(), reason="needs Triton"), pytest.mark.devices]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SLACK = 1e-6


@st.composite
def _rows(draw):
    from engine.sample_kernel import BLOCK

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
    from engine.sample_kernel import draw

    logits, temps, uniforms = case
    got = draw(logits.to(DEVICE), uniforms.to(DEVICE), temps.to(DEVICE)).cpu()
    _assert_inverse_cdf(torch.softmax(logits.float() / temps.unsqueeze(1), -1), uniforms, got)


@settings(max_examples=40, deadline=None)
@given(case=_rows())
def test_draw_from_given_probabilities_is_torchs_inverse_cdf(case):
    """Unnormalized probabilities with zeros (a filter's output): the same search, no softmax."""
    from engine.sample_kernel import draw

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
