"""The sampler's kernels, one Triton program a row: the draw, the inverse CDF (float64) of softmax(logits /
temperature), or of given unnormalized probabilities, at the row's uniform; and the argmax of an all-greedy batch.

torch's way, p = softmax(logits.float() / t), then a float64 cumsum over the vocabulary and a searchsorted, makes six
passes over a [bs, vocab] matrix and four of them write one; the float64 scan alone took 352 us of a 700 us draw at
bs 160 over Qwen3's 151,936 ids on the H200 (torch.profiler over the offline workload's decode steps). Here a program
reads its row once, then one block of it again, and writes nothing but its token: (1) block by block (BLOCK ids), y =
logits / t in float32, the block's max m_b and the float64 sum of exp(y - m_b), both held in registers, and whether
the row is valid; the blocks' masses are those sums times exp(m_b - max), their cumulative sum the row's CDF at block
ends; (2) the block whose cumulative mass first exceeds u x total, and in it the first id whose cumulative mass does
(searchsorted's right=True), never an id of zero mass, whatever the roundings. An online softmax needs the max
first and so a second pass; weights relative to each block's own max need none. The rule is sample.py's; the values
differ from torch's by the order of float32 and float64 roundings only, so a draw differs only where u x total falls
within those roundings of a CDF boundary. A row of logits with a NaN or without a finite maximum (sample.py's invalid
row) gets -1. A program waits on its blocks' loads one after another, so fewer, wider blocks pay. At 16 warps the
draw takes 82 registers a thread, so one program fits an SM and past 132 rows a second wave doubles the time; capped
at 64 (DRAW_MAX_REGISTERS: 6 spilled), two fit: GPU us a call in a CUDA graph on the H200 over Qwen3's vocabulary at bs
1 / 64 / 128 / 133 / 160 / 256, 36.0 / 36.8 / 37.0 / 71.8 / 81.7 / 84.1 uncapped, 37.5 / 37.6 / 38.0 / 58.1 / 60.7
/ 62.2 capped, the same tokens (a register cap changes no arithmetic). The argmax (47 registers, two programs an SM
already) walks a row the same way: 22.1-22.7 us up to 132 rows, 36.5 at 133, 42.1 at 256; a program's row is bound
by its SM's issue rate more than by loads, so two rows an SM take nearly twice one's time. Checked against sample.py's
float64 inverse CDF and torch's argmax by tests/test_sample_kernel.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 8192
NUM_WARPS = 16
# the draw's registers a thread: two programs an SM (a row each) instead of one, past 132 rows on the H200
DRAW_MAX_REGISTERS = 64
# in a block's flag sum, what a NaN or +inf id adds (a finite id adds 1, at most BLOCK of them)
NAN_OR_INF = tl.constexpr(1 << 16)


@triton.jit
def _block(x_row, start, V, t, TEMPER: tl.constexpr, BLOCK: tl.constexpr):
    """The block's ids' logits / t in float32 (-inf past V), or the given probabilities (0 past V); and the raw values
    (for the validity flags)."""
    offs = start + tl.arange(0, BLOCK)
    if TEMPER:
        x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        return x / t, x
    x = tl.load(x_row + offs, mask=offs < V, other=0.0).to(tl.float32)
    return x, x


@triton.jit
def _weights(y, m, TEMPER: tl.constexpr):
    """Weights proportional to the block's probabilities: exp(y - m) over the block's max m (0 at -inf), or the given
    probabilities."""
    if TEMPER:
        return tl.where(y > float("-inf"), tl.exp(y - m), 0.0)
    return y


@triton.jit
def _bad_and_finite(x):
    """The block's NaN or +inf ids and its finite ids, counted in one reduction (sample.py's invalid row: any of the
    first, or none of the second)."""
    flags = tl.sum(tl.where((x != x) | (x == float("inf")), NAN_OR_INF, (x > float("-inf")).to(tl.int32)), 0)
    return flags // NAN_OR_INF, flags % NAN_OR_INF


@triton.jit
def draw_kernel(x_ptr, stride, temps_ptr, u_ptr, out_ptr, V,
                TEMPER: tl.constexpr, NB: tl.constexpr, NB_P2: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride
    t = 1.0
    if TEMPER:
        t = tl.load(temps_ptr + row)
    # (1) each block's max and float64 sum of weights, as vectors; the validity counts
    blocks = tl.arange(0, NB_P2)
    maxes = tl.full([NB_P2], float("-inf"), tl.float32)
    sums = tl.zeros([NB_P2], tl.float64)
    finite = tl.zeros([], tl.int32)  # finite ids
    bad = tl.zeros([], tl.int32)  # NaN or +inf ids
    for b in range(0, NB):
        y, x = _block(x_row, b * BLOCK, V, t, TEMPER, BLOCK)
        m_b = 0.0
        if TEMPER:
            m_b = tl.max(y, 0)
            maxes = tl.where(blocks == b, m_b, maxes)
            bad_b, finite_b = _bad_and_finite(x)
            bad += bad_b
            finite += finite_b
        sums = tl.where(blocks == b, tl.sum(_weights(y, m_b, TEMPER).to(tl.float64), 0), sums)
    scale = tl.full([NB_P2], 1.0, tl.float64)
    if TEMPER:  # a block's mass relative to the row's max
        scale = tl.exp(maxes - tl.max(maxes, 0)).to(tl.float64)
    mass = sums * scale
    cdf = tl.cumsum(mass, 0)
    # below the CDF's own last value (u < 1), so the crossing block has mass
    point = tl.load(u_ptr + row) * tl.sum(tl.where(blocks == NB - 1, cdf, 0.0), 0)
    # (2) the crossing block, then the crossing id in it
    hit = tl.minimum(tl.sum((cdf <= point).to(tl.int32), 0), NB - 1)
    at_hit = blocks == hit
    before = tl.sum(tl.where(at_hit, cdf - mass, 0.0), 0)
    y, x = _block(x_row, hit * BLOCK, V, t, TEMPER, BLOCK)
    w = _weights(y, tl.sum(tl.where(at_hit, maxes, 0.0), 0), TEMPER).to(tl.float64)
    ids = tl.arange(0, BLOCK)
    has_mass = w > 0
    # the first id of mass whose cumulative mass exceeds the point; the block's scan sums in another order than its
    # mass did, so where rounding leaves none (a point within a rounding of the block's end), its last id of mass
    crossed = has_mass & (before + tl.cumsum(w, 0) * tl.sum(tl.where(at_hit, scale, 0.0), 0) > point)
    first = tl.min(tl.where(crossed, ids, BLOCK), 0)
    inside = tl.where(first < BLOCK, first, tl.max(tl.where(has_mass, ids, -1), 0))
    token = tl.minimum(tl.maximum(hit * BLOCK + inside, 0), V - 1).to(tl.int64)
    if TEMPER:
        token = tl.where((bad == 0) & (finite > 0), token, -1)
    tl.store(out_ptr + row, token)


def draw(x: torch.Tensor, uniforms: torch.Tensor, temperatures: torch.Tensor | None = None) -> torch.Tensor:
    """x [bs, vocab]: logits (any float dtype; with temperatures [bs] float32) or unnormalized probabilities (without);
    uniforms [bs] float64 in [0, 1) -> tokens [bs] int64. From logits, a row with a NaN or without a finite maximum
    gets -1; from probabilities, a row that is not finite gives some id in range."""
    bs, vocab = x.shape
    assert x.stride(1) == 1, "rows must be contiguous"
    nb = triton.cdiv(vocab, BLOCK)
    out = torch.empty(bs, dtype=torch.int64, device=x.device)
    temper = temperatures is not None
    draw_kernel[(bs,)](x, x.stride(0), temperatures if temper else uniforms, uniforms, out, vocab,
                       TEMPER=temper, NB=nb, NB_P2=triton.next_power_of_2(nb), BLOCK=BLOCK, num_warps=NUM_WARPS,
                       maxnreg=DRAW_MAX_REGISTERS)
    return out


@triton.jit
def argmax_kernel(x_ptr, stride, out_ptr, V, NB: tl.constexpr, BLOCK: tl.constexpr):
    """The row's argmax (the lowest id among equal maxima), -1 for a row with a NaN or without a finite maximum."""
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.zeros([], tl.int32)
    finite = tl.zeros([], tl.int32)
    bad = tl.zeros([], tl.int32)
    for b in range(0, NB):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        bad_b, finite_b = _bad_and_finite(x)
        bad += bad_b
        finite += finite_b
        m, i = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        best_id = tl.where(m > best, b * BLOCK + i, best_id)  # strictly: an earlier block keeps a tie
        best = tl.maximum(best, m)
    tl.store(out_ptr + row, tl.where((bad == 0) & (finite > 0), best_id.to(tl.int64), -1))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [bs, vocab] logits -> [bs] int64: each row's argmax, -1 for a row with a NaN or without a finite maximum."""
    bs, vocab = x.shape
    assert x.stride(1) == 1, "rows must be contiguous"
    out = torch.empty(bs, dtype=torch.int64, device=x.device)
    argmax_kernel[(bs,)](x, x.stride(0), out, vocab, NB=triton.cdiv(vocab, BLOCK), BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out
