"""The FA3 prefill work list a prefill graph builds on the device (engine/kernels/prefill_schedule.py; Triton's
interpreter on a CPU): exactly FlashInfer's items (one per query head, request and query tile, with the request's
offsets and lengths), each CTA's range in work_indptr, and the most a CTA runs within total / CTAs + the largest item
(hypothesis over batches of prompts, extends and empty entries, head sizes and CTA counts). On CUDA, the arrays a
graph prefill through the engine leaves in its wrapper's workspace hold the items FlashInfer's own scheduler produces
for the same lists (and test_prefill_graphs.py checks the logits and KV bit for bit against eager)."""

from __future__ import annotations

from typing import List, Tuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kernels import prefill_schedule

Item = Tuple[int, ...]


def flashinfer_items(qo_indptr: np.ndarray, kv_indptr: np.ndarray, kv_lens: np.ndarray, heads: int,
                     tile: int) -> List[Item]:
    """PrefillSM90Plan's items, enumerated as its loops do: (tile, qo offset, kv offset, qo len, kv len, head,
    request)."""
    out = []
    for h in range(heads):
        for i in range(len(kv_lens)):
            q = int(qo_indptr[i + 1] - qo_indptr[i])
            out += [(t, int(qo_indptr[i]), int(kv_indptr[i]), q, int(kv_lens[i]), h, i) for t in range(-(-q // tile))]
    return sorted(out)


def items_of(work: dict, n: int) -> List[Item]:
    cols = [work[name][:n] for name in prefill_schedule.FIELDS]
    return sorted(tuple(int(c[j]) for c in cols) for j in range(n))


def max_items(max_tokens: int, entries: int, num_heads: int, head_dim: int) -> int:
    """The most items `entries` entries of at most max_tokens tokens in all can make (FlashInfer's bound, which sizes
    a graph-mode plan's work arrays)."""
    return (-(-max_tokens // prefill_schedule.tile_q(head_dim)) + entries - 1) * num_heads


def read_work(ws: np.ndarray, offsets: List[int], ctas: int) -> Tuple[dict, np.ndarray]:
    """The work arrays in an int workspace's bytes at plan_info's eight offsets (work_indptr's the seventh): the
    fields, as far as work_indptr's last entry counts, and work_indptr."""
    indptr = ws[offsets[6]: offsets[6] + 4 * (ctas + 1)].view(np.int32)
    n = int(indptr[-1])
    return {name: ws[o: o + 4 * n].view(np.int32)
            for name, o in zip(prefill_schedule.FIELDS, offsets[:6] + offsets[7:8])}, indptr


def run_kernel(q_lens: List[int], cached: List[int], heads: int, ctas: int, head_dim: int, page: int = 1,
               ragged: bool = False):
    """The kernel (Triton's interpreter on a CPU) over pg_meta-shaped lists of these entries, into a workspace laid
    out as FlashInfer's graph-mode plan lays it out: (items, work_indptr, the lists)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = len(q_lens)
    kv = np.array([q + c if q else 0 for q, c in zip(q_lens, cached)], dtype=np.int64)
    meta = np.zeros((5, n + 1), dtype=np.int32)
    meta[0, 1:], meta[1, 1:], meta[4, :n] = np.cumsum(q_lens), np.cumsum(-(-kv // page)), kv
    capacity = max_items(sum(q_lens), n, heads, head_dim)
    stride = -(-capacity * 4 // 16) * 16
    offsets = [k * stride for k in range(7)] + [6 * stride + -(-4 * (ctas + 1) // 16) * 16]
    ws = torch.full((offsets[7] + stride,), 255, dtype=torch.uint8, device=device)
    prefill_schedule.sm90_schedule(torch.from_numpy(meta).to(device), n, ws, offsets, heads, ctas, head_dim, capacity,
                                   ragged)
    work, indptr = read_work(ws.cpu().numpy(), offsets, ctas)
    return work, indptr, meta


def makespan(work: dict, indptr: np.ndarray, tile: int) -> Tuple[float, float, float]:
    """(the most cost a CTA runs, the total, the largest item) in FlashInfer's cost units."""
    t, q, k = work["qo_tile_indices"], work["qo_len"], work["kv_len"]
    last = t + 1 == -(-q // tile)
    cost = 2 * tile + np.where(last, k, np.clip(k - q + (t + 1) * tile, 0, k))
    loads = [cost[a:b].sum() for a, b in zip(indptr, indptr[1:])]
    return max(loads), cost.sum(), cost.max()


@st.composite
def batches(draw):
    """Entries (extend length, cached prefix; some empty, as a graph's unused entries) and a page size."""
    n = draw(st.integers(1, 9))
    q = draw(st.lists(st.one_of(st.just(0), st.integers(1, 700)), min_size=n, max_size=n).filter(any))
    cached = draw(st.lists(st.integers(0, 1500), min_size=n, max_size=n))
    return q, cached, draw(st.sampled_from([1, 16]))


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from([(16, 128), (4, 64), (8, 256)]), st.sampled_from([132, 78, 7]), st.booleans())
def test_work_list_is_flashinfers_items_balanced(batch, heads_dim, ctas, ragged):
    """FlashInfer's items exactly, each CTA's range in work_indptr, the most any CTA runs within total / CTAs + the
    largest item. Ragged (prompts without a cached prefix, keys from the step's own tokens): the kv offsets are the
    token offsets, as FlashInfer's ragged plan takes kv_indptr = qo_indptr."""
    q_lens, cached, page = batch
    if ragged:  # (meta's kv_indptr, in pages, is not what the ragged items take)
        cached = [0] * len(q_lens)
    heads, head_dim = heads_dim
    work, indptr, meta = run_kernel(q_lens, cached, heads, ctas, head_dim, page, ragged)
    expected = flashinfer_items(meta[0], meta[0] if ragged else meta[1], meta[4, : len(q_lens)], heads,
                                prefill_schedule.tile_q(head_dim))
    assert indptr[0] == 0 and np.all(np.diff(indptr) >= 0) and indptr[-1] == len(expected)
    assert items_of(work, len(expected)) == expected
    most, total, largest = makespan(work, indptr, prefill_schedule.tile_q(head_dim))
    assert most <= total / ctas + largest


def test_a_long_prompt_is_better_balanced_than_flashinfers_order():
    """4096 tokens, 16 heads, 132 CTAs: FlashInfer's order (head by head, each item to the least loaded CTA) ends
    at 11648 cost units; the rounds end within 1% of total / CTAs (9185)."""
    work, indptr, _ = run_kernel([4096], [0], 16, 132, 128)
    most, total, _ = makespan(work, indptr, 128)
    assert most <= 1.01 * total / 132 < 11648


def device_items(wrapper, info: List[int], num_sms: int) -> List[Item]:
    """The items of the work arrays in a prefill graph wrapper's device int workspace, at its plan's offsets."""
    torch.cuda.synchronize()
    work, indptr = read_work(wrapper._int_workspace_buffer.cpu().numpy(), info, num_sms)
    return items_of(work, int(indptr[-1]))


@pytest.mark.cuda
@pytest.mark.parametrize("own", [True, False], ids=["ragged prompts", "paged extends"])
def test_graph_plan_work_arrays_on_the_device_are_flashinfers(own):
    """A graph prefill through the engine leaves in the device workspace (its prologue's work) the items FlashInfer's
    scheduler produces when it plans the same lists into the same wrapper (whose layout, plan_info, it keeps): three
    prompts through the ragged kernel, or three extends over cached prefixes through the paged one."""
    from engine import Engine, EngineConfig
    from engine.attention.flashinfer_backend import _PageLists
    from engine.core import SamplingParams
    from engine.distributed import DistributedInfo
    from harness import zoo
    from harness.driver import Driver

    zoo.prepare("tiny-qwen3")
    eng = Engine(EngineConfig(model_path=str(zoo.path("tiny-qwen3")), tp_info=DistributedInfo(0, 1), device="cuda",
                              dtype=torch.bfloat16, max_seq_len_override=1024, max_running_req=8,
                              prefill_graph_tokens=512, use_dummy_weight=True))
    try:
        backend = eng.attn_backend
        if own not in backend.prefill_graph:
            pytest.skip("no ragged prefill (FA2)")
        window, wrapper = next(iter(backend.prefill_graph[own].items()))
        if not backend.plan_prefill_directly or wrapper._backend != "fa3":
            pytest.skip("the device-built work list serves FA3 graph plans of the FlashInfer release it follows")
        lengths = [300, 7, 120]  # one graph batch of three prompts or extends (bucket 512)
        prefixes = [0, 0, 0] if own else [40, 300, 9]
        prompts = [[(13 * i + j) % 500 + 3 for j in range(n + c)] for i, (n, c) in enumerate(zip(lengths, prefixes))]
        Driver(eng).generate(prompts, SamplingParams(max_tokens=1), prefix_lens=None if own else prefixes)
        assert eng.graph_runner.last_prefill == (512, own)
        assert backend._sm90_layout(window, own) is not None
        info = [int(v) for v in wrapper._plan_info]
        ours = device_items(wrapper, info, backend.num_sms)
        meta = backend.pg_meta.cpu().numpy()
        entries = backend.prefill_graph_reqs + 1
        assert meta[0, len(lengths)] == sum(lengths)  # the lists of that batch are still in the static buffers
        lists = _PageLists(torch.from_numpy(meta[0, : entries + 1].copy()),
                           torch.from_numpy(meta[1, : entries + 1].copy()), None, None, None, (),
                           torch.from_numpy(meta[4, :entries].copy()))
        key = own, window
        saved, backend._sm90[key] = backend._sm90[key], None  # FlashInfer's scheduler this time
        try:
            backend._fast_prefill_plan(wrapper, lists, window, own)
        finally:
            backend._sm90[key] = saved
        assert [int(v) for v in wrapper._plan_info] == info
        theirs = device_items(wrapper, info, backend.num_sms)
        assert len(ours) > 0 and ours == theirs
    finally:
        eng.shutdown()
