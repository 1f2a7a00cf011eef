"""The timeline probe's Triton kernel (pdl_timeline.py has the chain, the variants and the reasons): a one-row GEMV
y = W x over BLOCK_N rows of W a program, all of K at once, launched under programmatic dependent launch; each
program stamps the GPU's global timer as it starts, after its wait and as it ends."""

import triton
import triton.language as tl


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def timeline_kernel(x_ptr, w_ptr, y_ptr, stamps_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    LOAD_W: tl.constexpr, WAIT: tl.constexpr, LOAD_X: tl.constexpr):
    pid = tl.program_id(0)
    start = _now()
    tl.extra.cuda.gdc_launch_dependents()  # the next call may launch as this program starts, as the skinny GEMM's
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    if LOAD_W:  # constant: loaded before the wait, as the skinny GEMM loads its weight
        acc += tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], eviction_policy="evict_first")
    if WAIT:
        tl.extra.cuda.gdc_wait()
    release = _now()
    if LOAD_X:  # written by the kernel before (here constant): read only after the wait
        x = tl.load(x_ptr + rk).to(tl.float32)[None, :]
        acc = acc * x if LOAD_W else acc + x
    tl.store(y_ptr + rn, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))
    end = _now()
    tl.store(stamps_ptr + pid * 3, start)
    tl.store(stamps_ptr + pid * 3 + 1, release)
    tl.store(stamps_ptr + pid * 3 + 2, end)
