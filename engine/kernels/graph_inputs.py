"""A decode graph's inputs gathered on the device in one Triton kernel.

A decode step's input ids are the tokens sampled a step before, which stay on the device (the driver's token pool),
and its KV slots are page-table entries: both are read at each request's last position. Gathered by torch, that is
two index_selects into new tensors and three copies into the graph's static inputs (one a conversion to int64), plus
three fills when the batch is padded; this kernel writes the static inputs directly, padding included. Its torch
reference is the eager path of GraphRunner.gather_decode_inputs (engine/graph.py); tests/test_graph_inputs.py checks
it against its definition.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256  # requests a program writes


def gather_decode_inputs(flat: torch.Tensor, positions: torch.Tensor, token_pool: torch.Tensor,
                         page_table: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                         dummy_slot: int) -> None:
    """For i < n = len(flat): ids[i] = token_pool.flat[flat[i]], slots[i] = page_table.flat[flat[i]] (int64),
    pos[i] = positions[i]; for n <= i < len(ids), the padding: id 0, position 0, dummy_slot. token_pool and
    page_table are int32 and of one shape; flat is int64, positions int32, all on one CUDA device."""
    n, size = flat.shape[0], ids.shape[0]
    assert token_pool.shape == page_table.shape and n <= size == pos.shape[0] == slots.shape[0]
    decode_inputs_kernel[(triton.cdiv(size, BLOCK),)](flat, positions, token_pool, page_table, ids, pos, slots, n,
                                                      size, dummy_slot, BLOCK=BLOCK, num_warps=4)


# n and size change with the batch and the graph, and where the static inputs' parts start with the graph's size:
# specialized on neither, the kernel compiles once
@triton.jit(do_not_specialize=["n", "size", "dummy_slot"],
            do_not_specialize_on_alignment=["flat_ptr", "positions_ptr", "ids_ptr", "pos_ptr", "slots_ptr"])
def decode_inputs_kernel(flat_ptr, positions_ptr, pool_ptr, table_ptr, ids_ptr, pos_ptr, slots_ptr, n, size,
                         dummy_slot, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    real = i < n
    f = tl.load(flat_ptr + i, mask=real, other=0)
    token = tl.load(pool_ptr + f, mask=real, other=0)
    slot = tl.where(real, tl.load(table_ptr + f, mask=real, other=0).to(tl.int64), dummy_slot)
    position = tl.load(positions_ptr + i, mask=real, other=0)
    ok = i < size
    tl.store(ids_ptr + i, token, mask=ok)
    tl.store(pos_ptr + i, position, mask=ok)
    tl.store(slots_ptr + i, slot, mask=ok)
