"""A planted fault's kernel (harness.fuzz.faults: page-ids-without-block-offset): engine/kernels/page_ids.py with its
loop's block offset dropped from the page-table load, so every block of 1024 pages reads the first block's place.
Imported only when the fault is planted (Triton, CUDA)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.page_ids import BLOCK


def page_ids_first_block(page_table: torch.Tensor, kv_indptr: torch.Tensor, rows: torch.Tensor, total: int,
                         page_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """engine.kernels.page_ids.page_ids, but wrong past each request's first BLOCK pages."""
    out = torch.empty(total, dtype=torch.int32, device=page_table.device) if out is None else out[:total]
    n = rows.shape[0]
    if n and total:
        _kernel[(n,)](page_table, page_table.stride(0), kv_indptr, rows, out, PAGE_SIZE=page_size, BLOCK=BLOCK,
                      num_warps=4)
    return out


@triton.jit(do_not_specialize_on_alignment=["indptr_ptr", "rows_ptr"])
def _kernel(table_ptr, stride_row, indptr_ptr, rows_ptr, out_ptr, PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    start = tl.load(indptr_ptr + i)
    count = tl.load(indptr_ptr + i + 1) - start
    src = table_ptr + tl.load(rows_ptr + i).to(tl.int64) * stride_row
    offs = tl.arange(0, BLOCK)
    for j0 in range(0, count, BLOCK):
        j = j0 + offs
        ok = j < count
        slot = tl.load(src + offs * PAGE_SIZE, mask=ok)  # the fault: offs where the kernel has j
        tl.store(out_ptr + start + j, slot // PAGE_SIZE, mask=ok)
