"""The page ids of the FlashInfer page lists (engine/attention/page_ids.py) against their definition: page j of entry
i is page_table[row_i, j * page_size] // page_size, at kv_indptr[i] + j. Hypothesis searches entry counts, rows
(repeated, the dummy's), page counts (0: a graph prefill's empty entry; up to a row's width; past one program's
block), page sizes and tables; on the CPU through Triton's interpreter. Every written id equals the definition and
nothing past total is touched (the output is exactly total long)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.layers import skinny_gemm

pytestmark = pytest.mark.skipif(not skinny_gemm.available(), reason="needs Triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(table: np.ndarray, rows: list, counts: list, page_size: int) -> np.ndarray:
    return np.array([table[r, j * page_size] // page_size for r, c in zip(rows, counts) for j in range(c)],
                    dtype=np.int64)


@st.composite
def _cases(draw):
    page_size = draw(st.sampled_from([1, 2, 16]))
    num_rows = draw(st.integers(1, 6))
    width = page_size * draw(st.sampled_from([1, 3, 40, 1100]))  # 1100 pages: two loop steps of one program
    n = draw(st.integers(1, 8))
    rows = draw(st.lists(st.integers(0, num_rows - 1), min_size=n, max_size=n))
    counts = draw(st.lists(st.integers(0, width // page_size), min_size=n, max_size=n))
    return page_size, num_rows, width, rows, counts, draw(st.integers(0, 2 ** 16))


@settings(max_examples=30, deadline=None)
@given(case=_cases())
def test_page_ids_match_their_definition(case):
    from engine.attention.page_ids import page_ids

    page_size, num_rows, width, rows, counts, seed = case
    gen = np.random.default_rng(seed)
    table = gen.integers(0, 1 << 20, size=(num_rows, width), dtype=np.int64).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    out = page_ids(torch.from_numpy(table).to(DEVICE), torch.from_numpy(indptr).to(DEVICE),
                   torch.tensor(rows, dtype=torch.int32, device=DEVICE), int(indptr[-1]), page_size)
    assert out.dtype == torch.int32 and out.shape == (int(indptr[-1]),)
    np.testing.assert_array_equal(out.cpu().numpy(), _reference(table, rows, counts, page_size))

