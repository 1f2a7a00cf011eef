"""The attention's inputs in one kernel: per-head RMSNorm of q and k (Qwen3), rotate-half RoPE of q and k, and K and V
written into the KV pool at their slots, in Triton.

Unfused, these are four kernels a layer (q norm, k norm, RoPE, the KV append), each reading and writing the heads again;
at a batch-1 decode step of a 0.6B model on the H200 they took 187 us of a 1.36 ms step, most of it launch and tail,
where this kernel takes 58 us (reports/bench/cuda/qwen3-0.6b). One program takes one head of BLOCK_T tokens: it loads
each token's two halves once, normalizes them in fp32 (weight product in fp32, one rounding, as FlashInfer's rmsnorm),
rotates the rounded values in fp32 with the fp32 cos/sin table (FlashInferOps.rope_table: HF's cos/sin rounded to the
model dtype) and rounds once, as FlashInfer's RoPE does; a q or k head is written back in place (a prompt's attention
may read its K from there: the ragged prefill), a k head and its v head go to the pool. A token's arithmetic is its own
row of the tile, and the tile's shape is fixed, so its result does not depend on the batch it runs in (graph padding,
prefill buckets). Its torch reference is TorchOps.qk_rope_store_ (engine/layers/ops.py): tests/test_qk_rope_store.py
checks the kernel against float64, the component checks (harness/components/ops.py) both against the exact result.
"""

from __future__ import annotations

import functools

import torch

from engine.utils.device import programmatic_launch

# Programmatic launch only where it measured faster (qwen3-0.6b decode graphs on the H200, the skinny GEMM launched
# so too): bs 1 1039 -> 998 us, bs 2 1087 -> 1049; slower from 4 tokens (bs 4 1141 -> 1229, bs 8 1317 -> 1510) and
# behind a prefill's cuBLAS GEMMs (a 4096-token prefill graph 12.5 -> 14.0 ms)
PDL_MAX_TOKENS = 2
# Tokens a program takes, the same for every batch (a token's bits must not depend on it). One token a program (one
# warp, 128 values) left a long prefill latency-bound; on the H200 a layer of 4096 tokens (67 MB moved) took 61 us that
# way and takes 22 us (3.1 TB/s) so, 512 tokens 8.8 -> 3.5 us, one token 1.49 -> 1.57 us.
BLOCK_T = 16


def supports(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether the kernel takes these views: a head_dim that is a power of two (Triton's block sizes are), unit
    stride along it."""
    d = q.shape[-1]
    return d >= 2 and d & (d - 1) == 0 and q.stride(-1) == 1 and kv.stride(-1) == 1


def qk_rope_store(positions: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor,
                  q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, k_pool: torch.Tensor,
                  v_pool: torch.Tensor, out_loc: torch.Tensor) -> None:
    """positions [N] int32; q [N, Hq, D] and kv [N, 2, Hkv, D], strided views with unit stride along D; table
    [max_pos, D] fp32 (cos | sin); q_weight, k_weight [D] or both None (no per-head norm); k_pool, v_pool
    [slots, Hkv, D] with unit stride along D; out_loc [N] int64 slots. q and kv's K are normalized and rotated in
    place, and K and V land at their slots."""
    n, hq, d = q.shape
    hkv = kv.shape[2]
    assert supports(q, kv) and k_pool.stride(2) == v_pool.stride(2) == 1, f"head_dim {d} or strides not supported"
    if n == 0:
        return
    norm = q_weight is not None
    index = q.device.index if q.device.index is not None else 0
    pdl = n <= PDL_MAX_TOKENS and q.is_cuda and programmatic_launch(index)
    _kernel()[(-(-n // BLOCK_T), hq + hkv)](
        positions, q, kv, table, q_weight if norm else table, k_weight if norm else table, k_pool, v_pool, out_loc, n,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), table.stride(0), k_pool.stride(0),
        k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), eps,
        HQ=hq, HALF=d // 2, HAS_NORM=norm, USE_PDL=pdl, BLOCK_T=BLOCK_T, num_warps=4,
        **({"launch_pdl": True} if pdl else {}))


@functools.cache
def _kernel():
    """The Triton kernel, built on first use (Triton is imported only on the path that needs it)."""
    import triton
    import triton.language as tl

    # N, and where positions and slots start, vary with every batch: specialized on them (N divisible by 16, the
    # pointers 16-byte aligned), the kernel compiled up to four variants, each the first time a batch's counts
    # met it, in the middle of a run
    @triton.jit(do_not_specialize=["N"], do_not_specialize_on_alignment=["N", "pos_ptr", "loc_ptr"])
    def qk_rope_store_kernel(pos_ptr, q_ptr, kv_ptr, table_ptr, qw_ptr, kw_ptr, k_pool_ptr, v_pool_ptr, loc_ptr, N,
                             stride_qn, stride_qh, stride_kvn, stride_kv2, stride_kvh, stride_table,
                             stride_ks, stride_kh, stride_vs, stride_vh, eps,
                             HQ: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr, USE_PDL: tl.constexpr,
                             BLOCK_T: tl.constexpr):
        if USE_PDL:  # everything it reads may come from the kernel before it: it only starts sooner
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        ok = t < N
        h = tl.program_id(1)
        is_q = h < HQ
        j = h - HQ  # the KV head, for h >= HQ
        d = tl.arange(0, HALF)[None, :]
        rows = t[:, None].to(tl.int64)
        m = ok[:, None]
        if is_q:
            src = q_ptr + rows * stride_qn + h * stride_qh
            w_ptr = qw_ptr
        else:
            src = kv_ptr + rows * stride_kvn + j * stride_kvh
            w_ptr = kw_ptr
        x1 = tl.load(src + d, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + d, mask=m, other=0.0).to(tl.float32)
        dtype = q_ptr.dtype.element_ty
        if HAS_NORM:
            rms = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
            x1 = (x1 * rms * tl.load(w_ptr + d).to(tl.float32)).to(dtype).to(tl.float32)
            x2 = (x2 * rms * tl.load(w_ptr + HALF + d).to(tl.float32)).to(dtype).to(tl.float32)
        row = table_ptr + tl.load(pos_ptr + t, mask=ok, other=0).to(tl.int64)[:, None] * stride_table
        cos = tl.load(row + d, mask=m, other=0.0)
        sin = tl.load(row + HALF + d, mask=m, other=0.0)
        y1 = (x1 * cos - x2 * sin).to(dtype)
        y2 = (x2 * cos + x1 * sin).to(dtype)
        tl.store(src + d, y1, mask=m)
        tl.store(src + HALF + d, y2, mask=m)
        if not is_q:
            slot = tl.load(loc_ptr + t, mask=ok, other=0)[:, None]
            k_dst = k_pool_ptr + slot * stride_ks + j * stride_kh
            tl.store(k_dst + d, y1, mask=m)
            tl.store(k_dst + HALF + d, y2, mask=m)
            v_src = src + stride_kv2
            v_dst = v_pool_ptr + slot * stride_vs + j * stride_vh
            tl.store(v_dst + d, tl.load(v_src + d, mask=m), mask=m)
            tl.store(v_dst + HALF + d, tl.load(v_src + HALF + d, mask=m), mask=m)

    return qk_rope_store_kernel
