"""y = x W^T (+ b) for a few rows of x (M <= 16: a decode step's projections), in Triton.

At M = 1 a projection is a matrix-vector product: it reads the whole weight once and does two flops a weight, so its
time is the weight's bytes over the memory bandwidth. cuBLAS's M = 1 kernels reach 8-41% of the H200's bandwidth on
a 0.6B model's layer shapes (reports/bench/skinny-gemm-h200.md); this kernel gives each program BLOCK_N rows of W and
walks K in BLOCK_K steps (up to all of K in one step, so that each program has its whole share of W in flight at
once), so many programs stream contiguous rows at once (no split-K: the decode shapes have N >= 512, enough programs
to fill the GPU without a second reduction kernel). The MLP's down projection can take the gated activation in: it
reads gate | up and forms act(gate) * up as it loads, one kernel fewer a layer (the fused ops do so at one row, where
it measured faster). Products accumulate in fp32 per lane and are reduced once at the end; the result is rounded once
to the model dtype, the bias added in fp32 first, as cuBLAS's epilogue does. It multiplies on CUDA cores, so past a
few rows cuBLAS's tensor cores win. On sm90 and later it launches with programmatic dependent launch: each program
loads its first K step of W (constant) before waiting on the kernel that writes x, so a projection's weight stream
starts under the previous kernel's tail (qwen3-0.6b on the H200: its decode graph at bs 1 1086 -> 1039 us, bs 2 1130
-> 1087, bs 4 1172 -> 1141, bit for bit the same logits), and lets the next kernel launch as it starts, not once its
own wait is over, so that in a chain (norm, gate_up, down) the third's weights stream while the first finishes
(decode graph at bs 1 / 2 / 4 / 8: 1043 / 1117 / 1223 / 1447 us -> 1009 / 1101 / 1212 / 1448; o_proj alone 2.50 ->
2.03 us, down 4.21 -> 3.91). At one row a program holds all of K (`whole_k`) and so loads its whole share of W before
that wait (the bench's M = 1 table, qkv / o_proj / gate_up / down 3.74 / 2.03 / 4.92 / 3.88 -> 2.65 / 1.89 / 3.72 /
2.72 us; the bs-1 decode graph 1006 -> 940 us). Every kernel the engine launches under PDL reads only constants
before its own wait and writes only after it, so a kernel started early neither reads what the ones before it have yet
to write nor overwrites what they still read.

Configurations (BLOCK_N, BLOCK_K, num_warps) come from a table measured on the device (`python -m
harness.bench.tune_gemm`: skinny_gemm_tuned.json, keyed by device name and "M,N,K" with M rounded up to a power of
two; null where cuBLAS was faster, so the kernel runs only where it paid), else from a rule. Rows are independent and
a row's sum order depends only on the configuration, which depends only on (BLOCK_M, N, K): a decode batch padded to
a CUDA-graph size gets the same bits as the eager batch (a prefill graph's bucket would not: ops.py keeps a prefill's
projections off it, but not its LM head, which runs after the graph on the batch's own rows). Checked against a
float64 product, and through the fused ops against cuBLAS (F.linear, the torch reference), by tests/test_skinny_gemm.py;
the tuner checks each configuration against float64 before it times it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Dict, Tuple

import torch

from engine.utils.device import programmatic_launch, sm_count

MAX_ROWS = 16
TABLE = Path(__file__).with_name("skinny_gemm_tuned.json")
# what one program may hold in fp32 accumulators: BLOCK_M * BLOCK_N * BLOCK_K <= 128 values a thread
ACC_PER_THREAD = 128
# without a measured entry, the kernel takes blocks of at most this many rows: its fp32 FMAs on CUDA cores do M
# multiply-adds a weight, which at M = 16 need as much as the H200's fp32 rate to keep up with its bandwidth, where
# cuBLAS's tensor cores do not
DEFAULT_MAX_BLOCK_M = 4

Config = Tuple[int, int, int]  # BLOCK_N, BLOCK_K, num_warps


def pow2_ceil(k: int) -> int:
    return 1 << max(0, k - 1).bit_length()


def block_m(m: int) -> int:
    """The rows a program holds: m rounded up to a power of two."""
    return pow2_ceil(m)


def fits(bm: int, config: Config) -> bool:
    bn, bk, warps = config
    return bm * bn * bk <= ACC_PER_THREAD * 32 * warps


def search_space(bm: int, k: int) -> list[Config]:
    """Every configuration the tuner tries (and the tests run) for a block of bm rows and reduction length k: each
    thread loads at least one 16-byte vector of W a step, and a step is no wider than K rounded up to a power of two
    (at one row the widest, where it fits, holds all of K: `whole_k`)."""
    out = []
    for bn in (1, 2, 4, 8):
        for bk in (256, 512, 1024, 2048, 4096):
            for warps in (1, 2, 4, 8):
                if bk <= max(256, pow2_ceil(k)) and bn * bk >= 256 * warps and fits(bm, (bn, bk, warps)):
                    out.append((bn, bk, warps))
    return out


def whole_k(bm: int, k: int, bk: int) -> Tuple[int, int] | None:
    """For one row, a step of bk >= K columns holds all of K in two tiles: (head, tail), the largest power of two
    <= K and the rest rounded up to a power of two (0 where K is one), so no lane loads a masked column and the
    program's whole share of W is loaded before it waits for x. None otherwise: K walked in steps of bk (the last
    one masked where bk does not divide K); the kernel's whole-K form holds one row."""
    if bm != 1 or bk < k:
        return None
    head = 1 << (k.bit_length() - 1)
    return head, 0 if k == head else pow2_ceil(k - head)


def default_config(bm: int, n: int, k: int, sms: int) -> Config:
    """Untuned rule: enough programs for two per SM, a 512-wide K step, four warps; shrunk to fit the registers."""
    bn = 8
    while bn > 1 and n // bn < 2 * sms:
        bn //= 2
    bk = 512 if k >= 512 else 256
    while not fits(bm, (bn, bk, 4)):
        if bk > 256:
            bk //= 2
        else:
            bn //= 2
    return bn, bk, 4


@functools.cache
def _table(device_name: str) -> Dict[str, Config | None]:
    if not TABLE.exists():
        return {}
    entries = json.loads(TABLE.read_text()).get(device_name, {})
    return {key: None if v is None else tuple(v) for key, v in entries.items()}


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny_gemm can take this call: 2-D x of at most MAX_ROWS rows with unit stride along K (K or 2K
    columns: gate | up, for a gated activation fused in), a contiguous half-precision weight of x's dtype, on CUDA."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
            and weight.dtype == x.dtype and weight.is_contiguous() and x.stride(1) == 1
            and x.shape[1] in (weight.shape[1], 2 * weight.shape[1]))


def choose(x: torch.Tensor, weight: torch.Tensor) -> Config | None:
    """The configuration to run x @ weight^T with, or None where cuBLAS is the faster (or the only) way: the
    device's measured entry for (BLOCK_M, N, K) (null where cuBLAS won), else the rule up to DEFAULT_MAX_BLOCK_M."""
    if not supports(x, weight):
        return None
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return _choice(block_m(x.shape[0]), weight.shape[0], weight.shape[1], index)


@functools.cache
def _choice(bm: int, n: int, k: int, device_index: int) -> Config | None:
    """choose's answer, once per shape and device (every eager decode asks it for every projection)."""
    table = _table(torch.cuda.get_device_name(device_index))
    key = f"{bm},{n},{k}"
    if key in table:
        return table[key]
    return default_config(bm, n, k, sm_count(device_index)) if bm <= DEFAULT_MAX_BLOCK_M else None


ACTS = {None: 0, "silu": 1, "gelu_tanh": 2}


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: Config | None = None, act: str | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N] in x's dtype; M <= MAX_ROWS (see `supports`). act "silu" or
    "gelu_tanh": x is [M, 2K], gate | up, and the product's input is act(gate) * up, computed in fp32 and rounded to
    x's dtype as the separate activation kernel rounds it, so the result is the unfused pair's."""
    m, (n, k) = x.shape[0], weight.shape
    assert x.shape[1] == (2 * k if act else k), f"x {tuple(x.shape)} for a weight {tuple(weight.shape)}, act {act}"
    bm = block_m(m)
    bn, bk, warps = config or default_config(bm, n, k, sm_count(x.device.index or 0))
    assert fits(bm, (bn, bk, warps)), f"configuration {(bn, bk, warps)} holds too many accumulators for {bm} rows"
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    pdl = x.is_cuda and programmatic_launch(x.device.index if x.device.index is not None else 0)
    tiles = whole_k(bm, k, bk)
    _kernel()[(-(-n // bn),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % bk == 0, ACT=ACTS[act], BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=tiles[0] if tiles else bk, WHOLE_K=tiles is not None, TAIL_K=tiles[1] if tiles else 0,
        USE_PDL=pdl, num_warps=warps, **({"launch_pdl": True} if pdl else {}))
    return y


@functools.cache
def _kernel():
    """The Triton kernel, imported on first use (Triton is imported only on the path that needs it)."""
    from engine.kernels.skinny_gemm_kernel import skinny_gemm_kernel

    return skinny_gemm_kernel
