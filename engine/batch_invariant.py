"""Batch-invariant compositions (EngineConfig.batch_invariant): a row's result does not depend on the other rows.

What makes a request's logits follow its batch on the CPU, measured with MKL (torch 2.13.0, fp32, AVX512):
- MKL's sgemm picks its kernel, and how its threads split the work, by the row count M, and a row's K-sum order
  follows: on an AMD EPYC a GEMM of fewer than four rows, and the rows left over where the threads' shares of M are
  not multiples of four, take a GEMV or small-M kernel; on an Intel Xeon every M below 16 does (10 at a 256 x 256
  weight), and at 2 threads M = 57-81 and more of a [576, 1536] weight another split. What held on both, at every shape
  the zoo's models use and at 1-4 threads: at one fixed M, a row's bits depend neither on its place among the M rows
  nor on the other rows. So every GEMM runs as GEMMs of exactly BLOCK_ROWS rows, the last zero-padded.
- torch's element-wise loops run a vector body and a scalar tail, and its transcendental functions (exp in silu,
  tanh in gelu) round differently in the two. The tail's place follows where the threads' chunks of the flat tensor
  begin, which follows the row count: at 3 threads silu(gate) * up of 200 rows of 512 differs from the rows alone.
  So the activation runs on blocks of rows small enough for one thread (numel below torch's grain size), where every
  row is one vector body and the same tail.
- attention over a batch padded to its longest request sums each query's keys in blocks whose lengths follow that
  longest one: the torch backend attends each request on its own (attention/torch_backend.py).

`check_gemm` re-measures the GEMM property for a weight at engine start, so a BLAS with other paths fails loudly
instead of breaking the promise quietly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK_ROWS = 16  # every GEMM of the mode has this many rows: at or past the small-M kernels of both CPUs measured
GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE: an element-wise op over fewer elements runs on one thread


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose rows do not depend on how many there are: GEMMs of BLOCK_ROWS rows, the last zero-padded."""
    rows = x.shape[0]
    if rows == BLOCK_ROWS:
        return F.linear(x, weight, bias)
    blocks = max(1, -(-rows // BLOCK_ROWS))
    padded = x.new_zeros(blocks * BLOCK_ROWS, x.shape[1])
    padded[:rows] = x
    out = x.new_empty(blocks * BLOCK_ROWS, weight.shape[0])
    for start in range(0, blocks * BLOCK_ROWS, BLOCK_ROWS):
        out[start: start + BLOCK_ROWS] = F.linear(padded[start: start + BLOCK_ROWS], weight, bias)
    return out[:rows]


def act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """[N, 2I] (gate | up) -> act(gate) * up [N, I], on blocks of rows that one thread computes."""
    inter = gate_up.shape[1] // 2
    block = max(1, (GRAIN_SIZE - 1) // inter)
    out = gate_up.new_empty(gate_up.shape[0], inter)
    for start in range(0, gate_up.shape[0], block):
        gate, up = gate_up[start: start + block].chunk(2, dim=-1)
        torch.mul(F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh"), up,
                  out=out[start: start + block])
    return out


def check_gemm(weight: torch.Tensor, max_rows: int = 300) -> None:
    """Raise if `linear` gives a row different bits at different row counts or places here (this BLAS's rows follow
    more than M), measured on random rows through `weight` [O, K]."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(max_rows, weight.shape[1], generator=gen).to(weight.device, weight.dtype)
    full = linear(x, weight)
    for rows in (1, 2, 3, 5, 7, 9, 11, 15, 17, 19, 25, 27, 57, 64, 81, max_rows - 1):
        part = linear(x[-rows:], weight)
        if not torch.equal(part, full[-rows:]):
            raise RuntimeError(
                f"batch_invariant: this machine's BLAS computes a GEMM row differently at {rows} rows than at "
                f"{max_rows} (weight {list(weight.shape)}, {weight.dtype}) even in blocks of {BLOCK_ROWS} rows, so "
                "the mode's promise cannot be kept on this machine")
