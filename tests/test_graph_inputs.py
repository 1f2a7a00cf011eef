"""The decode graph's input gather (engine/kernels/graph_inputs.py) against its definition: for each of n requests,
its id and KV slot read from the token pool and the page table at its flat index, its position copied; the padding up
to the graph's size id 0, position 0 and the dummy slot; nothing past the size touched. Hypothesis searches request
counts (one, a program's block and past it), padding, pool shapes and indices (the dummy's row among them); on the CPU
through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.utils.device import has_triton

pytestmark = [pytest.mark.skipif(not has_triton(), reason="needs Triton"), pytest.mark.devices]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SENTINEL = -7


@st.composite
def _cases(draw):
    from engine.kernels.graph_inputs import BLOCK

    rows, width = draw(st.integers(1, 5)), draw(st.sampled_from([1, 3, 64]))
    n = draw(st.sampled_from([1, 2, 7, BLOCK - 1, BLOCK, BLOCK + 3]))
    size = n + draw(st.sampled_from([0, 1, 5, BLOCK]))
    flat = draw(st.lists(st.integers(0, rows * width - 1), min_size=n, max_size=n))
    return rows, width, flat, size, draw(st.integers(0, 2 ** 16))


@settings(max_examples=25, deadline=None)
@given(case=_cases())
def test_gather_decode_inputs_matches_its_definition(case):
    from engine.kernels.graph_inputs import gather_decode_inputs

    rows, width, flat, size, seed = case
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, 1 << 20, (rows, width), generator=gen, dtype=torch.int32)
    table = torch.randint(0, 1 << 30, (rows, width), generator=gen, dtype=torch.int32)
    positions = torch.randint(0, 1 << 20, (len(flat),), generator=gen, dtype=torch.int32)
    flat_t = torch.tensor(flat, dtype=torch.int64)
    dummy = 123456
    # outputs one longer than size, to see that the kernel stops at size
    ids, pos = (torch.full((size + 1,), SENTINEL, dtype=torch.int32, device=DEVICE) for _ in range(2))
    slots = torch.full((size + 1,), SENTINEL, dtype=torch.int64, device=DEVICE)
    gather_decode_inputs(flat_t.to(DEVICE), positions.to(DEVICE), pool.to(DEVICE), table.to(DEVICE), ids[:size],
                         pos[:size], slots[:size], dummy)
    n, pad = len(flat), size - len(flat)
    want_ids = torch.cat([pool.view(-1)[flat_t], torch.zeros(pad, dtype=torch.int32), torch.tensor([SENTINEL])])
    want_pos = torch.cat([positions, torch.zeros(pad, dtype=torch.int32), torch.tensor([SENTINEL])])
    want_slots = torch.cat([table.view(-1)[flat_t].long(), torch.full((pad,), dummy), torch.tensor([SENTINEL])])
    assert torch.equal(ids.cpu(), want_ids.int()), n
    assert torch.equal(pos.cpu(), want_pos.int()), n
    assert torch.equal(slots.cpu(), want_slots), n
