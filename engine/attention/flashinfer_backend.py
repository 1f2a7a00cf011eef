"""FlashInfer attention over the paged pool (CUDA, fp16/bf16, any page size).

Prefill and extend use the paged prefill kernel (causal, with the cached prefix in the page list); decode uses the
paged decode kernel, with one CUDA-graph wrapper per captured batch size whose index buffers are static.
Planning is host-side work done in prepare_metadata, once per batch, not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

import torch

from engine.attention.base import AttentionBackend, BaseAttnMetadata
from engine.core import Batch, get_global_ctx

WORKSPACE_BYTES = 256 << 20


@dataclass
class FlashInferMetadata(BaseAttnMetadata):
    wrapper: Any  # the planned prefill, decode or graph-decode wrapper


@dataclass
class _PageLists:
    qo_indptr: torch.Tensor  # [bs + 1] int32 host
    kv_indptr: torch.Tensor  # [bs + 1] int32 host, in pages
    kv_indices: torch.Tensor  # [total pages] int32 device, page ids
    last_page_len: torch.Tensor  # [bs] int32 host


class FlashInferBackend(AttentionBackend):
    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        import flashinfer

        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.device, self.dtype = device, dtype
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD")
        # Tensor cores pay off from a group of 4 q heads per KV head; below, the plain decode kernel is faster.
        self.use_tensor_cores = num_qo_heads // num_kv_heads >= 4
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD", use_tensor_cores=self.use_tensor_cores)
        self.graph_wrappers: Dict[int, Any] = {}
        self.graph_indptr: torch.Tensor | None = None
        self.graph_indices: torch.Tensor | None = None
        self.graph_last_page_len: torch.Tensor | None = None
        # plan() fills pinned host buffers and copies them to the device asynchronously; the next plan waits for
        # those copies, so a plan never overwrites a buffer a copy in flight still reads.
        self.planned = torch.cuda.Event()

    def _page_lists(self, batch: Batch) -> _PageLists:
        ctx = get_global_ctx()
        ps = ctx.page_size
        reqs = batch.padded_reqs
        kv_lens = torch.tensor([r.device_len for r in reqs], dtype=torch.int32)
        num_pages = (kv_lens + ps - 1) // ps
        pin = dict(dtype=torch.int32, pin_memory=True)
        qo_indptr = torch.zeros(len(reqs) + 1, **pin)
        qo_indptr[1:] = torch.tensor([r.extend_len for r in reqs], dtype=torch.int32).cumsum(0)
        kv_indptr = torch.zeros(len(reqs) + 1, **pin)
        kv_indptr[1:] = num_pages.cumsum(0)
        # One gather for the whole batch: the page table holds token slots, and the slot at each page's first
        # position divided by page_size is the page id.
        rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64).repeat_interleave(num_pages.long())
        cols = (torch.arange(int(kv_indptr[-1])) - kv_indptr[:-1].long().repeat_interleave(num_pages.long())) * ps
        slots = ctx.page_table[rows.pin_memory().to(self.device, non_blocking=True),
                               cols.pin_memory().to(self.device, non_blocking=True)]
        last = ((kv_lens - 1) % ps + 1).pin_memory()
        return _PageLists(qo_indptr, kv_indptr, slots // ps if ps > 1 else slots, last)

    def _plan_common(self) -> dict:
        return dict(num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                    page_size=get_global_ctx().page_size, q_data_type=self.dtype, kv_data_type=self.dtype)

    def prepare_metadata(self, batch: Batch, wrapper: Any = None) -> None:
        lists = self._page_lists(batch)
        self.planned.synchronize()
        if batch.is_prefill:
            wrapper = self.prefill
            wrapper.plan(lists.qo_indptr, lists.kv_indptr, lists.kv_indices, lists.last_page_len,
                         head_dim_qk=self.head_dim, causal=True, **self._plan_common())
        else:
            # a decode batch padded to a captured size plans straight into that graph's static buffers
            wrapper = wrapper or self.graph_wrappers.get(batch.padded_size, self.decode)
            wrapper.plan(lists.kv_indptr, lists.kv_indices, lists.last_page_len, head_dim=self.head_dim,
                         **self._plan_common())
        self.planned.record()
        batch.attn_metadata = FlashInferMetadata(cu_seqlens_q=lists.qo_indptr.to(self.device, non_blocking=True),
                                                 wrapper=wrapper)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        kv_cache = get_global_ctx().kv_cache
        kv_cache.store_kv(k, v, batch.out_loc, layer_id)
        out = batch.attn_metadata.wrapper.run(q, (kv_cache.k_cache(layer_id), kv_cache.v_cache(layer_id)))
        return out.reshape(q.shape[0], -1)

    # ------------------------------------------------------------------ CUDA graphs (decode)
    def init_capture_graph(self, max_seq_len: int, bs_list: List[int]) -> None:
        max_bs = max(bs_list)
        max_pages = -(-max_seq_len // get_global_ctx().page_size)
        self.graph_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self.graph_indices = torch.zeros(max_bs * max_pages, dtype=torch.int32, device=self.device)
        self.graph_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=self.device)

    def prepare_for_capture(self, batch: Batch) -> None:
        import flashinfer

        bs = batch.padded_size
        self.graph_wrappers[bs] = flashinfer.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
            self.workspace, self.graph_indptr[: bs + 1], self.graph_indices, self.graph_last_page_len[:bs],
            kv_layout="NHD", use_tensor_cores=self.use_tensor_cores)
        self.prepare_metadata(batch, self.graph_wrappers[bs])

    def prepare_for_replay(self, batch: Batch) -> None:
        """prepare_metadata already planned into the captured wrapper, whose buffers the graph reads."""
        assert batch.attn_metadata.wrapper is self.graph_wrappers[batch.padded_size]
