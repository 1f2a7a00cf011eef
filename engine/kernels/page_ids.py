"""The paged-attention page lists' page ids, gathered on the device from the page table in one Triton kernel.

FlashInfer reads each request's pages as kv_indices[kv_indptr[i]:kv_indptr[i + 1]]; page j of request i is the page
holding its position j * page_size: page_table[row_i, j * page_size] // page_size. The host sends O(batch) integers
(the rows and indptr), never a list that grows with the context; one kernel launch replaces the ten small torch ops
(repeat_interleave, aranges, a gather, a division) it took before. Checked against that definition by
tests/test_page_ids.py, alone and inside the FlashInfer backend's page lists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # pages a program writes per loop step


def page_ids(page_table: torch.Tensor, kv_indptr: torch.Tensor, rows: torch.Tensor, total: int,
             page_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [total] page ids for entries with page-table rows `rows` [n] and page offsets kv_indptr [n + 1] (both
    int32, on page_table's device; kv_indptr[n] == total), written into out[:total] when given."""
    out = torch.empty(total, dtype=torch.int32, device=page_table.device) if out is None else out[:total]
    n = rows.shape[0]
    if n and total:
        page_ids_kernel[(n,)](page_table, page_table.stride(0), kv_indptr, rows, out, PAGE_SIZE=page_size,
                              BLOCK=BLOCK, num_warps=4)
    return out


# the page lists are rows of one int32 buffer of n + 1 columns, so where kv_indptr and rows start varies with the
# request count n: not specialized on it (16-byte aligned or not), the kernel compiles once
@triton.jit(do_not_specialize_on_alignment=["indptr_ptr", "rows_ptr"])
def page_ids_kernel(table_ptr, stride_row, indptr_ptr, rows_ptr, out_ptr, PAGE_SIZE: tl.constexpr,
                    BLOCK: tl.constexpr):
    i = tl.program_id(0)
    start = tl.load(indptr_ptr + i)
    count = tl.load(indptr_ptr + i + 1) - start
    src = table_ptr + tl.load(rows_ptr + i).to(tl.int64) * stride_row
    offs = tl.arange(0, BLOCK)
    for j0 in range(0, count, BLOCK):
        j = j0 + offs
        ok = j < count
        slot = tl.load(src + j * PAGE_SIZE, mask=ok)
        tl.store(out_ptr + start + j, slot // PAGE_SIZE, mask=ok)
