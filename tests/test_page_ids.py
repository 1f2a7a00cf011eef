"""The page ids of the FlashInfer page lists (engine/kernels/page_ids.py) against their definition: page j of entry
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

from engine.utils.device import has_triton

pytestmark = [pytest.mark.skipif(not has_triton(), reason="needs Triton"), pytest.mark.devices]
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
    from engine.kernels.page_ids import page_ids

    page_size, num_rows, width, rows, counts, seed = case
    gen = np.random.default_rng(seed)
    table = gen.integers(0, 1 << 20, size=(num_rows, width), dtype=np.int64).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    out = page_ids(torch.from_numpy(table).to(DEVICE), torch.from_numpy(indptr).to(DEVICE),
                   torch.tensor(rows, dtype=torch.int32, device=DEVICE), int(indptr[-1]), page_size)
    assert out.dtype == torch.int32 and out.shape == (int(indptr[-1]),)
    np.testing.assert_array_equal(out.cpu().numpy(), _reference(table, rows, counts, page_size))


@st.composite
def _batches(draw):
    """A decode or prefill batch of requests on distinct rows (a decode's padding: the dummy's row, repeated), and
    for a graph prefill the bucket its tokens pad up to and the graph's fixed entry count."""
    page_size = draw(st.sampled_from([1, 4, 16]))
    n = draw(st.integers(1, 6))
    phase = draw(st.sampled_from(["decode", "prefill"]))
    rows = draw(st.permutations(range(8)))[:n]
    spans = []
    for _ in range(n):
        cached = draw(st.integers(0, 70))
        spans.append((cached, 1 if phase == "decode" else draw(st.integers(1, 40))))
    graph = draw(st.booleans())  # a graph prefill, or a decode the graph of its size replays
    pad = draw(st.integers(0, 30)) if graph and phase == "prefill" else 0
    return page_size, phase, rows, spans, graph, pad, draw(st.integers(0, 2)), draw(st.booleans())


@settings(max_examples=40, deadline=None)
@given(case=_batches(), seed=st.integers(0, 2 ** 16))
def test_the_backends_page_lists_match_their_definition(case, seed):
    """FlashInferBackend._page_lists (host math in numpy, page ids on the device) against each entry's definition:
    qo_indptr from the extend lengths, kv_indptr from the page counts, the last page's fill (0 for a graph prefill's
    empty entry), the page ids, the plan's schedule key; the padding entries of a graph prefill last, on the dummy
    row, owning the padding tokens. A graph's lists are in the static buffers its wrappers read, whole after another
    step's lists went through the same pinned host buffer; a graph prefill's page ids are gathered by its
    graph_prologue."""
    from engine.attention.flashinfer_backend import FlashInferBackend
    from engine.core import Batch, Context, Req, set_global_ctx

    page_size, phase, rows, spans, graph, pad, empty, tensor_cores = case
    dummy_row, width = 8, 112
    table = np.random.default_rng(seed).integers(0, 1 << 16, size=(9, width)).astype(np.int32)

    def req(cached: int, extend: int, row: int, uid: int) -> Req:
        ids = torch.zeros(cached + extend, dtype=torch.int32)
        return Req(ids, row, cached, 1, uid, None, None)  # type: ignore[arg-type]

    reqs = [req(c, e, row, i) for i, (row, (c, e)) in enumerate(zip(rows, spans))]
    batch = Batch(reqs=reqs, phase=phase)
    batch.padded_reqs = list(reqs)
    graph_prefill, graph_decode = graph and phase == "prefill", graph and phase == "decode"
    batch.padded_tokens = sum(e for _, e in spans) + pad if graph_prefill else 0
    backend = object.__new__(FlashInferBackend)
    backend.device, backend.use_tensor_cores = torch.device(DEVICE), tensor_cores
    backend._host_views = {}
    n_graph = len(reqs) + empty  # the graph's request entries; the padding entry follows them
    backend.prefill_graph_reqs, backend.prefill_dummy_row = n_graph, dummy_row
    static = dict(dtype=torch.int32, device=DEVICE)
    backend.pg_meta = torch.full((5, n_graph + 2), -7, **static)  # the graphs' static buffers
    backend.pg_indices = torch.full((width * (n_graph + 1),), -7, **static)
    backend.dg_meta = torch.full((5, len(reqs) + 1 + empty), -7, **static)  # decode graphs up to len + empty
    backend.graph_indices = torch.full((width * (len(reqs) + empty),), -7, **static)
    backend.graph_wrappers = {len(reqs): {}} if graph_decode else {}
    backend.prefill_graph = {False: {}}  # no wrappers: the prologue gathers the page ids (FA3 work: test_prefill_schedule)
    ctx = Context(page_size)
    ctx.page_table = torch.from_numpy(table).to(DEVICE)
    set_global_ctx(ctx)
    # a step before this one, on the same backend, left other lists in the graphs' pinned host buffers (decode: more
    # entries): this step's lists must not keep any of them
    before = [req(max(0, c - 7), e, row, i) for i, (row, (c, e)) in enumerate(zip(rows, spans))]
    if phase == "decode":
        before += [req(4, 1, dummy_row, 99)] * empty
    previous = Batch(reqs=before, phase=phase)
    previous.padded_reqs = list(before)
    previous.padded_tokens = batch.padded_tokens
    if graph_decode:
        backend.graph_wrappers[len(before)] = {}
    try:
        written = len(backend._page_lists(previous).kv_indices)
        lists = backend._page_lists(batch)
        if graph_prefill:
            backend.graph_prologue(batch)
    finally:
        set_global_ctx(None)
    entries = [(c + e, e, row) for row, (c, e) in zip(rows, spans)]
    if graph_prefill:
        entries += [(0, 0, dummy_row)] * (n_graph - len(reqs)) + [(pad, pad, dummy_row)]
    pages = [-(-kv // page_size) for kv, _, _ in entries]
    np.testing.assert_array_equal(lists.qo_indptr.numpy(), np.cumsum([0] + [e for _, e, _ in entries]))
    np.testing.assert_array_equal(lists.qo_indptr_device.cpu().numpy(), lists.qo_indptr.numpy())
    np.testing.assert_array_equal(lists.kv_indptr.numpy(), np.cumsum([0] + pages))
    np.testing.assert_array_equal(lists.last_page_len.numpy(),
                                  [(kv - 1) % page_size + 1 if kv else 0 for kv, _, _ in entries])
    np.testing.assert_array_equal(lists.kv_indices.cpu().numpy(),
                                  _reference(table, [r for _, _, r in entries], pages, page_size))
    np.testing.assert_array_equal(lists.kv_lens.numpy(), [kv for kv, _, _ in entries])
    if graph:  # a graph's lists are the static buffers its wrappers read
        meta, indices = (backend.pg_meta, backend.pg_indices) if graph_prefill else (backend.dg_meta,
                                                                                     backend.graph_indices)
        assert lists.kv_indices.data_ptr() == indices.data_ptr()
        assert lists.qo_indptr_device.data_ptr() == meta.data_ptr()
        for row, host in ((0, lists.qo_indptr), (1, lists.kv_indptr), (2, lists.last_page_len), (4, lists.kv_lens)):
            np.testing.assert_array_equal(meta[row, : len(host)].cpu().numpy(), host.numpy())
        np.testing.assert_array_equal(meta[3, : len(entries)].cpu().numpy(), [r for _, _, r in entries])
        assert (indices[max(written, len(lists.kv_indices)):] == -7).all()  # nothing written past the lists
    lens = [kv for kv, _, _ in entries] if tensor_cores else pages
    assert lists.schedule == ((len(entries), tuple(lens)) if batch.is_decode else ())
