"""The skinny GEMM's Triton kernel (skinny_gemm.py has the launch, the configurations and the reasons): each program
takes BLOCK_N rows of W and walks K in BLOCK_K steps, accumulating x * w per lane in fp32 and reducing once; for one
row of x (WHOLE_K) it holds all of K at once instead, as a power-of-two tile of BLOCK_K columns and a tail of TAIL_K.
Checked against a float64 product by tests/test_skinny_gemm.py."""

import triton
import triton.language as tl


@triton.jit
def x_tile(x_ptrs, x_ok, K, ACT: tl.constexpr):
    """A K step of the product's input: x, or act(gate) * up when x holds gate | up (up is K columns on)."""
    x = tl.load(x_ptrs, mask=x_ok, other=0.0)
    if ACT:
        g = x.to(tl.float32)
        if ACT == 1:
            a = g / (1.0 + tl.exp(-g))
        else:  # gelu, tanh form: 0.5 g (1 + tanh(u)) = g sigmoid(2u)
            u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            a = g / (1.0 + tl.exp(-2.0 * u))
        x = (a * tl.load(x_ptrs + K, mask=x_ok, other=0.0).to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _dot_row(x, w):
    """[BLOCK_N]: the vector x times each row of w, products in fp32, summed once."""
    return tl.sum(x.to(tl.float32)[None, :] * w.to(tl.float32), axis=1)


@triton.jit
def skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WHOLE_K: tl.constexpr, TAIL_K: tl.constexpr,
                       USE_PDL: tl.constexpr):
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm[:, None] < M
    col_ok = rn[:, None] < N
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    w_ptrs = w_rows + rk[None, :]
    # Under PDL the next kernel may launch at once (it waits for this one to finish before it reads what this one
    # writes), and W, which is constant, is loaded before waiting on the kernel that writes x: all of the program's
    # W (WHOLE_K), else its first K step
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if WHOLE_K:  # one row (BLOCK_M == 1), BLOCK_K <= K: the head tile needs no K mask, the tail covers the rest
        w = tl.load(w_ptrs, mask=col_ok, other=0.0, eviction_policy="evict_first")
        if TAIL_K:
            rt = BLOCK_K + tl.arange(0, TAIL_K)
            w_tail = tl.load(w_rows + rt[None, :], mask=col_ok & (rt[None, :] < K), other=0.0,
                             eviction_policy="evict_first")
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        out = _dot_row(x_tile(x_ptr + rk, rk < K, K, ACT), w)
        if TAIL_K:
            out += _dot_row(x_tile(x_ptr + rt, rt < K, K, ACT), w_tail)
        out = out[None, :]  # [1, BLOCK_N]
    else:
        x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
        x_ok, w_ok = row_ok, col_ok
        if not EVEN_K:
            x_ok, w_ok = row_ok & (rk[None, :] < K), col_ok & (rk[None, :] < K)
        w = tl.load(w_ptrs, mask=w_ok, other=0.0, eviction_policy="evict_first")
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        x = x_tile(x_ptrs, x_ok, K, ACT)
        acc = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            x_ok, w_ok = row_ok, col_ok
            if not EVEN_K:
                k_ok = (k0 + rk)[None, :] < K
                x_ok, w_ok = row_ok & k_ok, col_ok & k_ok
            w = tl.load(w_ptrs, mask=w_ok, other=0.0, eviction_policy="evict_first")
            acc += x_tile(x_ptrs, x_ok, K, ACT).to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        out = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], out.to(y_ptr.dtype.element_ty),
             mask=row_ok & (rn[None, :] < N))
