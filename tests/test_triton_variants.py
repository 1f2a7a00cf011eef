"""The eager path's Triton kernels compile once, whatever a batch's token and request counts: the driver's inputs
are views into one buffer (positions after n ids, slots after 2n), the backend's page lists rows of an n + 1 column
buffer, so where they start, like the token count itself, varies with every batch; a kernel specialized on that
compiled a new variant the first time a count met it, in the middle of a run (an offline run's eager prefills took
0.85 s instead of 0.30 on a fresh H200). CUDA only: the interpreter compiles nothing."""

from __future__ import annotations

import pytest
import torch

from engine.utils.device import has_triton

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not (torch.cuda.is_available() and has_triton()),
                                                   reason="needs a CUDA GPU and Triton")]


def _variants(kernel) -> int:
    """Compiled variants of a Triton kernel, over devices: its per-device caches of compiled kernels (device_caches'
    first member in recent Triton releases, a dict a device in older ones)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(cache[0]) for cache in caches.values())
    return sum(len(cache) for cache in kernel.cache.values())


def test_qk_rope_store_compiles_once_for_any_count_and_offset():
    from engine.kernels import qk_rope_store as fused
    from engine.layers.rotary import cos_sin_table
    from engine.models.config import RotaryConfig

    dev, hq, hkv, d = torch.device("cuda"), 4, 2, 128
    table = cos_sin_table(RotaryConfig(d, 512, 1e6, None), 512).to(dev)
    pool = torch.zeros(2, 256, hkv, d, dtype=torch.bfloat16, device=dev)
    counts = []
    for n in (15, 16, 17, 18, 19, 32):
        for offset in range(4):  # positions and slots as the driver lays them out: views at offsets in one buffer
            positions = torch.arange(4 + n, dtype=torch.int32, device=dev)[offset: offset + n]
            slots = torch.arange(4 + n, dtype=torch.int64, device=dev)[offset: offset + n]
            qkv = torch.randn(n, (hq + 2 * hkv) * d, dtype=torch.bfloat16, device=dev)
            q = qkv[:, : hq * d].view(n, hq, d)
            kv = qkv[:, hq * d:].view(n, 2, hkv, d)
            fused.qk_rope_store(positions, q, kv, table, None, None, 1e-6, pool[0], pool[1], slots)
            counts.append(_variants(fused._kernel()))
    assert counts[-1] == counts[0], counts


def test_page_ids_compiles_once_for_any_entry_count():
    from engine.kernels.page_ids import page_ids, page_ids_kernel

    dev = torch.device("cuda")
    table = torch.arange(4 * 64, dtype=torch.int32, device=dev).view(4, 64)
    counts = []
    for n in range(1, 9):  # the backend's lists: rows of one [5, n + 1] buffer
        lists = torch.zeros(5, n + 1, dtype=torch.int32, device=dev)
        lists[1] = torch.arange(n + 1, dtype=torch.int32, device=dev) * 3
        lists[3, :n] = torch.arange(n, dtype=torch.int32, device=dev) % 4
        out = page_ids(table, lists[1], lists[3, :n], 3 * n, 1)
        assert torch.equal(out.cpu(), table[lists[3, :n].long(), :3].flatten().cpu())
        counts.append(_variants(page_ids_kernel))
    assert counts[-1] == counts[0], counts


def test_decode_input_gather_compiles_once_for_any_count_and_graph_size():
    from engine.graph import _input_views
    from engine.kernels.graph_inputs import decode_inputs_kernel, gather_decode_inputs

    dev = torch.device("cuda")
    pool = torch.arange(4 * 64, dtype=torch.int32, device=dev).view(4, 64)
    block = torch.zeros(4 * 300, dtype=torch.int32, device=dev)
    counts = []
    for n, size in ((1, 1), (2, 2), (3, 4), (5, 8), (16, 16), (17, 24), (200, 256)):
        host = torch.zeros(5 * n, dtype=torch.int32, device=dev)  # the driver's buffer: flat, feed, positions
        flat, positions = host[: 2 * n].view(torch.int64), host[4 * n:]
        flat.copy_(torch.arange(n, device=dev) % pool.numel())
        ids, pos, slots = _input_views(block, size)  # the graph's static inputs, where they start for this size
        gather_decode_inputs(flat, positions, pool, pool, ids, pos, slots, 0)
        assert torch.equal(ids[:n].cpu(), pool.view(-1)[flat].cpu())
        counts.append(_variants(decode_inputs_kernel))
    assert counts[-1] == counts[0], counts
