"""Batch-invariant compositions (EngineConfig.batch_invariant): a row's result does not depend on the other rows.

What makes a request's logits follow its batch on the CPU, measured with MKL 2024.2 (torch 2.13.0, fp32, AVX512):
- MKL's sgemm computes rows four at a time in its blocked kernel; a GEMM of fewer than four rows, and the one to
  three rows left over where the threads' shares of M are not multiples of four, go to a GEMV or a small-M kernel that
  sums K in another order (at 2 threads: M in 1-3, 5-7 and 9-11; at 16 threads also 17-19 and 25-27). With M a
  multiple of four, a row's bits depend neither on M (4 to 600) nor on its position or the other rows, at every shape
  the zoo's models use and at 1, 2, 3, 4, 6, 8 and 16 threads. So a GEMM's rows are zero-padded to a multiple of 4.
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

UNIFORM_ROWS = 4  # MKL's blocked sgemm computes rows in groups of this many
GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE: an element-wise op over fewer elements runs on one thread


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose rows do not depend on how many there are: zero-padded to a multiple of UNIFORM_ROWS."""
    rows = x.shape[0]
    if rows % UNIFORM_ROWS == 0 and rows:
        return F.linear(x, weight, bias)
    padded = x.new_zeros(max(UNIFORM_ROWS, -(-rows // UNIFORM_ROWS) * UNIFORM_ROWS), x.shape[1])
    padded[:rows] = x
    return F.linear(padded, weight, bias)[:rows]


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
    """Raise if `linear` gives a row different bits at different row counts here (this BLAS computes rows other than
    in groups of UNIFORM_ROWS), measured on random rows through `weight` [O, K] at the counts that break F.linear."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(max_rows, weight.shape[1], generator=gen).to(weight.device, weight.dtype)
    full = F.linear(x, weight)
    for rows in (1, 2, 3, 5, 6, 7, 9, 10, 11, 17, 18, 19, 25, 26, 27, 64, max_rows - 1):
        part = linear(x[-rows:], weight)
        if not torch.equal(part, full[-rows:]):
            raise RuntimeError(
                f"batch_invariant: this machine's BLAS computes a GEMM row differently at {rows} rows than at {max_rows} (weight {list(weight.shape)}, {weight.dtype}): its "
                f"row-count-independent path does not start at {UNIFORM_ROWS} rows here, so the mode's promise "
                "cannot be kept on this machine")
