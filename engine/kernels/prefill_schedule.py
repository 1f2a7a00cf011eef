"""The work list of FlashInfer's SM90 (FA3) prefill kernels, paged and ragged, computed on the device in one Triton
program.

The kernel runs a persistent grid of one CTA per SM; CTA c processes the work items work_indptr[c] .. work_indptr[c+1]
one after another, an item being one query tile (128 rows; 192 at head_dim 64) of one request for one query head,
over all of that tile's keys: no split of the keys, so an item's result does not depend on which CTA runs it, or when.
FlashInfer's plan (PrefillSM90Plan) builds the list in C++ on the host, before every launch: about 65 us for a
128-token prompt and 0.75 ms for a 4096-token one (1.3 us an item) on the H200's hosts. A prefill graph instead
builds it in its prologue, from the page lists already in its static buffers, so the host plans nothing.

The items are FlashInfer's (one per head, request and tile, with the request's offsets and lengths); their order is
not: they are sorted by FlashInfer's own cost (2 x tile rows + the keys the tile sees) and dealt out in rounds of one
per CTA, every other round in reverse (each round's largest item goes to the CTA whose last item was the previous
round's smallest). That ends within total / CTAs + the largest item, as any greedy list schedule, and on prompts of
several rounds 10-35% below FlashInfer's order, which hands the items out head by head (a 4096-token prompt on 132
CTAs: 9214 against 11648 cost units; the floor is 9185). Checked by tests/test_prefill_schedule.py: FlashInfer's
items (as its plan makes them; on CUDA, against the arrays its own plan writes) and that bound.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

# the work arrays' fields, in the order of their offsets in FlashInfer's PrefillPlanSM90Info (work_indptr, its 7th
# offset, lies between head_indices and batch_indices)
FIELDS = ("qo_tile_indices", "qo_indptr", "kv_indptr", "qo_len", "kv_len", "head_indices", "batch_indices")


def tile_q(head_dim_vo: int) -> int:
    return 192 if head_dim_vo == 64 else 128


def sm90_schedule(meta: torch.Tensor, entries: int, workspace: torch.Tensor, offsets: Sequence[int], num_heads: int,
                  num_ctas: int, head_dim_vo: int, capacity: int, ragged: bool = False) -> None:
    """Write the work arrays of the entries in meta (int32 [5, >= entries + 1]: qo_indptr, kv_indptr in pages, -,
    -, kv lengths, as the prefill graphs' pg_meta) into the int workspace (uint8) at FlashInfer's byte offsets
    (PrefillPlanSM90Info's first eight). capacity: the most items the arrays hold (the plan sized them). ragged:
    for the ragged kernel over the step's own K and V (entries without a cached prefix), whose kv offsets are the
    entries' token offsets, qo_indptr's."""
    assert all(o % 4 == 0 for o in offsets), offsets
    block = triton.next_power_of_2(capacity)
    sm90_schedule_kernel[(1,)](
        meta, meta.stride(0), workspace.view(torch.int32), *(o // 4 for o in offsets), entries, num_heads, num_ctas,
        RAGGED=ragged, TILE=tile_q(head_dim_vo), BLOCK_W=block, MAX_COST=(1 << 31) // block - 1,
        BLOCK_C=triton.next_power_of_2(num_ctas + 1), num_warps=8)


@triton.jit
def _item_fields(i, T, meta_ptr, meta_stride, num_entries, RAGGED: tl.constexpr, TILE: tl.constexpr):
    """Item i = head * T + global tile g: (tile in its request, head, request, qo offset, kv offset, qo len, kv len,
    cost), the entries walked once (a request's tiles follow the earlier requests')."""
    g = i % T
    t = tl.zeros_like(i)
    req, qo, kv, q, k, nt = t, t, t, t, t, t
    start = tl.load(meta_ptr) * 0
    for e in range(num_entries):
        qo0 = tl.load(meta_ptr + e)
        ql = tl.load(meta_ptr + e + 1) - qo0
        ntl = (ql + TILE - 1) // TILE
        inside = (g >= start) & (g < start + ntl)
        t = tl.where(inside, g - start, t)
        req = tl.where(inside, e, req)
        qo = tl.where(inside, qo0, qo)
        if RAGGED:  # no cached prefix: the keys are the entry's own tokens
            kv_e = qo0
        else:
            kv_e = tl.load(meta_ptr + meta_stride + e)
        kv = tl.where(inside, kv_e, kv)
        q = tl.where(inside, ql, q)
        k = tl.where(inside, tl.load(meta_ptr + 4 * meta_stride + e), k)
        nt = tl.where(inside, ntl, nt)
        start += ntl
    # causal, right-aligned queries: a tile sees the keys up to its last row; the last tile sees them all
    seen = tl.where(t + 1 == nt, k, tl.minimum(tl.maximum(k - q + (t + 1) * TILE, 0), k))
    return t, i // T, req, qo, kv, q, k, 2 * TILE + seen


@triton.jit
def _cta_start(c, F, m, num_ctas):
    """Where CTA c's items start: F full rounds each, plus the CTAs before it that get one of the last, partial
    round's m items (dealt forward when F is even, backward when odd)."""
    return c * F + tl.where(F % 2 == 0, tl.minimum(c, m), tl.maximum(c - (num_ctas - m), 0))


@triton.jit
def sm90_schedule_kernel(meta_ptr, meta_stride, ws_ptr, off_tile, off_qo, off_kv, off_qlen, off_kvlen, off_head,
                         off_indptr, off_batch, num_entries, num_heads, num_ctas, RAGGED: tl.constexpr,
                         TILE: tl.constexpr,
                         BLOCK_W: tl.constexpr, MAX_COST: tl.constexpr, BLOCK_C: tl.constexpr):
    tiles = tl.load(meta_ptr) * 0
    for e in range(num_entries):
        tiles += (tl.load(meta_ptr + e + 1) - tl.load(meta_ptr + e) + TILE - 1) // TILE
    T = tl.maximum(tiles, 1)
    W = tiles * num_heads
    i = tl.arange(0, BLOCK_W)
    idx = i  # rank j's item: in one round every item has a CTA of its own, in any order
    if W > num_ctas:  # largest cost first, ties by item index; the items past W sort last
        _, _, _, _, _, _, _, cost = _item_fields(i, T, meta_ptr, meta_stride, num_entries, RAGGED, TILE)
        key = tl.where(i < W, tl.minimum(cost, MAX_COST) * BLOCK_W + (BLOCK_W - 1 - i), -1)
        idx = BLOCK_W - 1 - tl.sort(key, descending=True) % BLOCK_W
    t, head, req, qo, kv, q, k, _ = _item_fields(idx, T, meta_ptr, meta_stride, num_entries, RAGGED, TILE)

    # rank j goes to CTA c in round r (F full rounds, m items in the last)
    r = i // num_ctas
    p = i % num_ctas
    c = tl.where(r % 2 == 0, p, num_ctas - 1 - p)
    F = W // num_ctas
    m = W % num_ctas
    pos = _cta_start(c, F, m, num_ctas) + r
    ok = i < W
    tl.store(ws_ptr + off_tile + pos, t, mask=ok)
    tl.store(ws_ptr + off_qo + pos, qo, mask=ok)
    tl.store(ws_ptr + off_kv + pos, kv, mask=ok)
    tl.store(ws_ptr + off_qlen + pos, q, mask=ok)
    tl.store(ws_ptr + off_kvlen + pos, k, mask=ok)
    tl.store(ws_ptr + off_head + pos, head, mask=ok)
    tl.store(ws_ptr + off_batch + pos, req, mask=ok)
    cc = tl.arange(0, BLOCK_C)
    tl.store(ws_ptr + off_indptr + cc, _cta_start(cc, F, m, num_ctas), mask=cc <= num_ctas)
