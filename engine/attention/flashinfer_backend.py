"""FlashInfer attention over the paged pool (CUDA, fp16/bf16, any page size, sliding windows).

Prefill and extend use the paged prefill kernel (causal, with the cached prefix in the page list); decode uses the
paged decode kernel, with one CUDA-graph wrapper per captured batch size whose index buffers are static. Models with
sliding layers get a second wrapper of each kind, planned with window_left = window - 1 (HF's rule: the query's own
key and window - 1 before it); the kernel never reads a page outside the window, though such pages stay allocated.

The page lists are built on the device from the page table (a gather, no per-request Python and no host tensor that
grows with the context); the host sends O(batch) integers a step. K and V are written by one kernel per layer
(append_paged_kv_cache) at each token's position in its request's page list. Planning happens once per batch, in
prepare_metadata. A CUDA-graph decode refills its static page buffers every step and keeps only its schedule while the
batch size and page counts repeat: FlashInfer's decode plan (DecodePlan: each request's split of its pages into chunks)
reads the page counts alone, and with tensor cores (PrefillPlan) the lengths; the kernels read the page ids from the
static buffers at replay. A plan is never valid for a slot, only for a shape: a slot's next request has other pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

import torch

from engine.attention.base import AttentionBackend, BaseAttnMetadata, layer_windows
from engine.core import Batch, get_global_ctx
from engine.models.config import ModelConfig

WORKSPACE_BYTES = 256 << 20


@dataclass
class FlashInferMetadata(BaseAttnMetadata):
    wrappers: Dict[int, Any]  # window_left -> the planned prefill, decode or graph-decode wrapper
    kv_indptr: torch.Tensor  # [bs + 1] int32, device: each request's pages, where its K and V are appended
    kv_indices: torch.Tensor  # [>= total pages] int32, device
    last_page_len: torch.Tensor  # [bs] int32, device
    batch_indices: torch.Tensor  # [num_tokens] int32, device: each token's request


@dataclass
class _PageLists:
    qo_indptr: torch.Tensor  # [bs + 1] int32, pinned host
    kv_indptr: torch.Tensor  # [bs + 1] int32, pinned host, in pages
    last_page_len: torch.Tensor  # [bs] int32, pinned host
    kv_indices: torch.Tensor  # [total pages] int32, device: page ids
    schedule: tuple  # what a decode plan's schedule depends on: batch size, page counts (lengths with tensor cores)


class FlashInferBackend(AttentionBackend):
    def __init__(self, config: ModelConfig, num_qo_heads: int, num_kv_heads: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        import flashinfer

        self.fi = flashinfer
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, config.head_dim
        self.device, self.dtype = device, dtype
        self.sm_scale = config.attn_scale or config.head_dim ** -0.5
        # FlashInfer's window_left counts the keys left of the query: HF's window minus the query's own
        self.layer_window_left = [-1 if w is None else w - 1 for w in layer_windows(config)]
        self.windows = sorted(set(self.layer_window_left))
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # Tensor cores pay off from a group of 4 q heads per KV head; below, the plain decode kernel is faster.
        self.use_tensor_cores = num_qo_heads // num_kv_heads >= 4
        # Wrappers of one step run one after another, so they share the float workspace.
        self.prefill = {w: flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD")
                        for w in self.windows}
        self.decode = {w: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD", use_tensor_cores=self.use_tensor_cores) for w in self.windows}
        self.graph_wrappers: Dict[int, Dict[int, Any]] = {}  # padded bs -> window_left -> wrapper
        self.graph_plan: tuple | None = None  # the schedule the last graph plan was made for
        self.graph_indptr = self.graph_indices = self.graph_last_page_len = self.graph_batch_indices = None
        # plan() fills pinned host buffers and copies them to the device asynchronously; the next plan waits for
        # those copies, so a plan never overwrites a buffer a copy in flight still reads.
        self.planned = torch.cuda.Event()

    # ------------------------------------------------------------------ page lists, on the device
    def _page_lists(self, batch: Batch) -> _PageLists:
        ctx = get_global_ctx()
        ps, reqs = ctx.page_size, batch.padded_reqs
        n = len(reqs)
        host = torch.tensor([[r.device_len for r in reqs], [r.extend_len for r in reqs], [r.table_idx for r in reqs]],
                            dtype=torch.int64)
        kv_lens, ext, rows = host
        num_pages = (kv_lens + ps - 1) // ps
        indptrs = torch.zeros(3, n + 1, dtype=torch.int32, pin_memory=True)  # qo, kv, last_page_len (n entries)
        indptrs[0, 1:] = ext.cumsum(0)
        indptrs[1, 1:] = num_pages.cumsum(0)
        indptrs[2, :n] = (kv_lens - 1) % ps + 1
        total = int(indptrs[1, n])
        # page ids: page_table[row, j * page_size] // page_size for page j of each request, in one gather
        dev = torch.cat([rows, num_pages, indptrs[1, :n].long()]).pin_memory().to(self.device, non_blocking=True)
        rows_d, pages_d, starts_d = dev.split(n)
        owner = torch.repeat_interleave(torch.arange(n, device=self.device), pages_d, output_size=total)
        page_col = (torch.arange(total, device=self.device) - starts_d[owner]) * ps
        slots = ctx.page_table[rows_d[owner], page_col]
        indices = slots if ps == 1 else torch.div(slots, ps, rounding_mode="floor")
        lens = num_pages if not self.use_tensor_cores else kv_lens
        return _PageLists(indptrs[0], indptrs[1], indptrs[2, :n], indices.int(), (n, tuple(lens.tolist())))

    def _plan_args(self, window_left: int) -> dict:
        return dict(num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                    page_size=get_global_ctx().page_size, window_left=window_left, sm_scale=self.sm_scale,
                    q_data_type=self.dtype, kv_data_type=self.dtype)

    def prepare_metadata(self, batch: Batch) -> None:
        lists = self._page_lists(batch)
        self.planned.synchronize()
        graph = self.graph_wrappers.get(batch.padded_size) if batch.is_decode else None
        if batch.is_prefill:
            wrappers = self.prefill
            for w, wrapper in wrappers.items():
                wrapper.plan(lists.qo_indptr, lists.kv_indptr, lists.kv_indices, lists.last_page_len,
                             head_dim_qk=self.head_dim, causal=True, **self._plan_args(w))
        elif graph is not None:
            wrappers = graph
            self._plan_graph(batch.padded_size, graph, lists)
        else:
            wrappers = self.decode
            self._plan_decode(wrappers, lists)
        self.planned.record()
        batch.attn_metadata = self._metadata(batch, lists, wrappers, graph is not None)

    def _plan_decode(self, wrappers: Dict[int, Any], lists: _PageLists) -> None:
        for w, wrapper in wrappers.items():
            wrapper.plan(lists.kv_indptr, lists.kv_indices, lists.last_page_len, head_dim=self.head_dim,
                         **self._plan_args(w))

    def _metadata(self, batch: Batch, lists: _PageLists, wrappers: Dict[int, Any], graph: bool) -> FlashInferMetadata:
        n = batch.padded_size
        if graph:  # the static buffers the captured graph reads (filled by the plan)
            return FlashInferMetadata(
                cu_seqlens_q=lists.qo_indptr.to(self.device, non_blocking=True), wrappers=wrappers,
                kv_indptr=self.graph_indptr[: n + 1], kv_indices=self.graph_indices,
                last_page_len=self.graph_last_page_len[:n], batch_indices=self.graph_batch_indices[:n])
        host = torch.cat([lists.qo_indptr, lists.kv_indptr, lists.last_page_len]).pin_memory()
        qo_indptr, kv_indptr, last_page_len = host.to(self.device, non_blocking=True).split([n + 1, n + 1, n])
        batch_indices = torch.repeat_interleave(torch.arange(n, dtype=torch.int32, device=self.device),
                                                qo_indptr.diff(), output_size=int(lists.qo_indptr[-1]))
        return FlashInferMetadata(cu_seqlens_q=qo_indptr, wrappers=wrappers, kv_indptr=kv_indptr,
                                  kv_indices=lists.kv_indices, last_page_len=last_page_len,
                                  batch_indices=batch_indices)

    def _plan_graph(self, bs: int, wrappers: Dict[int, Any], lists: _PageLists) -> None:
        """Fill the graph's static buffers with this batch's pages (every step: a row's next request has other
        pages), then plan, unless the last plan's schedule still holds for these page counts."""
        from flashinfer.decode import fast_decode_plan

        total = len(lists.kv_indices)
        self.graph_indptr[: bs + 1].copy_(lists.kv_indptr, non_blocking=True)
        self.graph_indices[:total].copy_(lists.kv_indices)
        self.graph_last_page_len[:bs].copy_(lists.last_page_len, non_blocking=True)
        if self.graph_plan == lists.schedule:
            return
        self.graph_plan = lists.schedule
        for w, wrapper in wrappers.items():
            fast_decode_plan(wrapper, self.graph_indptr[: bs + 1], self.graph_indices[:total],
                             lists.last_page_len, head_dim=self.head_dim, global_override_indptr_cpu=lists.kv_indptr,
                             **self._plan_args(w))

    def forward(self, q: torch.Tensor, kv: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        kv_cache = get_global_ctx().kv_cache
        paged = (kv_cache.k_cache(layer_id), kv_cache.v_cache(layer_id))
        self._store(kv, paged, batch)
        wrapper = batch.attn_metadata.wrappers[self.layer_window_left[layer_id]]
        return wrapper.run(q, paged).view(q.shape[0], -1)

    def _store(self, kv: torch.Tensor, paged: tuple, batch: Batch) -> None:
        """K and V [N, Hkv, D] (strided views) into the pages, at each token's position: one kernel. The slots
        are the ones batch.out_loc names, derived from the same page table (the padding rows' go to the dummy page)."""
        md: FlashInferMetadata = batch.attn_metadata
        self.fi.append_paged_kv_cache(kv[:, 0], kv[:, 1], md.batch_indices, batch.positions, paged, md.kv_indices,
                                      md.kv_indptr, md.last_page_len, kv_layout="NHD")

    # ------------------------------------------------------------------ CUDA graphs (decode)
    def init_capture_graph(self, max_seq_len: int, bs_list: List[int]) -> None:
        max_bs = max(bs_list)
        max_pages = -(-max_seq_len // get_global_ctx().page_size)
        self.graph_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self.graph_indices = torch.zeros(max_bs * max_pages, dtype=torch.int32, device=self.device)
        self.graph_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        self.graph_batch_indices = torch.arange(max_bs, dtype=torch.int32, device=self.device)

    def prepare_for_capture(self, batch: Batch) -> None:
        """Create the size's wrappers (sharing the static buffers) and plan them fully once: capturing records
        the kernels their plan picked, and a graph-mode plan keeps those kernels valid for any later plan."""
        import flashinfer

        bs = batch.padded_size
        self.graph_wrappers[bs] = {w: flashinfer.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
            self.workspace, self.graph_indptr[: bs + 1], self.graph_indices, self.graph_last_page_len[:bs],
            kv_layout="NHD", use_tensor_cores=self.use_tensor_cores) for w in self.windows}
        lists = self._page_lists(batch)
        self.planned.synchronize()
        self._plan_decode(self.graph_wrappers[bs], lists)
        self.planned.record()
        self.graph_plan = None
        batch.attn_metadata = self._metadata(batch, lists, self.graph_wrappers[bs], graph=True)

    def prepare_for_replay(self, batch: Batch) -> None:
        """prepare_metadata already planned into the captured wrappers, whose buffers the graph reads."""
        assert batch.attn_metadata.wrappers is self.graph_wrappers[batch.padded_size]
