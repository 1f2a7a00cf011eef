"""FlashInfer attention over the paged pool (CUDA, fp16/bf16, any page size, sliding windows).

Prefill and extend use the paged prefill kernel (causal, with the cached prefix in the page list), except that on sm90
(FA3) a prefill without a cached prefix uses the ragged kernel over the step's own K and V (forward's kv: the
projection's K, left normalized and rotated by the store), which reads them where the projection left them instead of
gathering them back from the pool page by page (qwen3-0.6b's heads on the H200: 6.3 / 11.3 / 140 us a layer at 128 / 512
/ 4096 tokens against 7.6 / 13.9 / 165); decode uses the paged decode kernel, with one CUDA-graph wrapper per captured
batch size whose index buffers are static. Models with sliding layers get a second wrapper of each kind, planned with
window_left = window - 1 (HF's rule: the query's own key and window - 1 before it); the kernel never reads a page
outside the window, though such pages stay allocated.

The page lists are built on the device from the page table (a gather, no per-request Python and no host tensor that
grows with the context); the host sends O(batch) integers a step. K and V are already in the pool when forward runs
(the attention layer's ops write them at batch.out_loc). Planning happens once per batch, in prepare_metadata. A
CUDA-graph decode refills its static page buffers every step and keeps only its schedule while the batch size and page
counts repeat: FlashInfer's decode plan (DecodePlan: each request's split of its pages into chunks)
reads the page counts alone, and with tensor cores (PrefillPlan) the lengths; the kernels read the page ids from the
static buffers at replay. A plan is never valid for a slot, only for a shape: a slot's next request has other pages.
Prefill and extend graphs use one graph-mode prefill wrapper per window over static buffers (init_prefill_graphs), and
with FA3 a ragged one for the graphs of batches without a cached prefix; paged graphs gather their page ids themselves
and, with FA3 (sm90), graphs of either kind build its work list too (graph_prologue, kernels/prefill_schedule.py), so
the host plans nothing for them. A graph's page lists reach its static buffers in one
host-to-device copy a step (_page_lists).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import numpy as np
import torch

from engine.attention.base import AttentionBackend, BaseAttnMetadata, layer_windows
from engine.core import Batch, get_global_ctx
from engine.kernels.page_ids import page_ids
from engine.kernels.prefill_schedule import sm90_schedule
from engine.models.config import ModelConfig
from engine.utils.device import pin

WORKSPACE_BYTES = 256 << 20
FAST_PLAN_FLASHINFER = "0.6.13"  # the release whose prefill plan _fast_prefill_plan follows (and was tested with)


@dataclass
class FlashInferMetadata(BaseAttnMetadata):
    wrappers: Dict[int, Any]  # window_left -> the planned prefill, decode or graph-decode wrapper
    own_kv: bool = False  # the wrappers are ragged: they attend over forward's kv


@dataclass
class _PageLists:
    qo_indptr: torch.Tensor  # [bs + 1] int32, pinned host
    kv_indptr: torch.Tensor  # [bs + 1] int32, pinned host, in pages
    last_page_len: torch.Tensor  # [bs] int32, pinned host
    kv_indices: torch.Tensor | None  # [total pages] int32, device: page ids (None: a ragged prefill reads none)
    qo_indptr_device: torch.Tensor  # [bs + 1] int32, device
    # what a decode plan's schedule depends on: batch size, page counts (lengths with tensor cores); () for a prefill
    schedule: tuple
    kv_lens: torch.Tensor  # [bs] int32, pinned host


@dataclass
class _HostViews:
    """A pinned host buffer of _page_lists' five rows and the views a step's lists are made of (host rows cut to n
    entries; a static buffer's device rows, None for an eager batch's own copy)."""
    host: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    last_page_len: torch.Tensor
    kv_lens: torch.Tensor
    static: torch.Tensor | None
    qo_indptr_device: torch.Tensor | None
    kv_indptr_device: torch.Tensor | None
    rows_device: torch.Tensor | None


class FlashInferBackend(AttentionBackend):
    def __init__(self, config: ModelConfig, num_qo_heads: int, num_kv_heads: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        import flashinfer

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
        # the ragged prefill where the paged one is FA3's: the same kernel family, so a prompt's graph and eager
        # forwards agree bit for bit as the paged ones do (FA2 would split the keys in graph mode only)
        self.ragged_prefill = flashinfer.utils.determine_attention_backend(device, 0, False, False, dtype,
                                                                           dtype) == "fa3"
        self.ragged = {w: flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, kv_layout="NHD")
                       for w in self.windows} if self.ragged_prefill else {}
        self.graph_wrappers: Dict[int, Dict[int, Any]] = {}  # padded bs -> window_left -> wrapper
        self.graph_plan: tuple | None = None  # the schedule the last graph plan was made for
        self.dg_meta = self.graph_indices = None  # the decode graphs' static page lists (init_capture_graph)
        # own_kv -> window_left -> graph-mode prefill wrapper, paged (False) or ragged (True) (init_prefill_graphs)
        self.prefill_graph: Dict[bool, Dict[int, Any]] = {}
        self.prefill_graph_planned: set = set()  # the kinds planned once (the plan that sizes their work arrays)
        # _fast_prefill_plan calls the scheduler with the argument list of this FlashInfer release; other releases
        # plan through wrapper.plan every time
        self.plan_prefill_directly = flashinfer.__version__ == FAST_PLAN_FLASHINFER
        # plan() fills pinned host buffers (FlashInfer's, and the graphs' page lists in _static_views) and copies
        # them to the device asynchronously; the next step waits for those copies before it writes the lists, so
        # neither overwrites a buffer a copy in flight still reads.
        self.planned = torch.cuda.Event()
        # the engine's stream (current when the engine makes its backend), passed to record(): without one, record()
        # looks the current stream up through a chain of Python calls (over 10 us on the H200's host, before a
        # prefill's launch)
        self.stream = torch.cuda.current_stream(device)
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._sm90: Dict[Tuple[bool, int], Tuple[List[int], int] | None] = {}  # (own_kv, window) -> _sm90_layout
        self._host_views: Dict[Tuple[Tuple[int, ...], int], _HostViews] = {}  # (static shape, entries) -> views

    # ------------------------------------------------------------------ page lists, on the device
    def _entries(self, batch: Batch) -> List[List[int]]:
        """[kv lengths, extend lengths, page-table rows] of the attention entries: batch.padded_reqs, and for a graph
        prefill the empty entries and the padding entry (last, on the dummy's row) that make up the graph's fixed
        count; the padding entry owns the padding tokens, at positions 0, 1, ... of its own sequence."""
        reqs = batch.padded_reqs
        entries = [[r.device_len for r in reqs], [r.extend_len for r in reqs], [r.table_idx for r in reqs]]
        if batch.is_prefill and batch.padded_tokens:
            pad, empty = batch.padded_tokens - sum(entries[1]), self.prefill_graph_reqs - len(reqs)
            for column, fill in zip(entries, ([0] * empty + [pad], [0] * empty + [pad],
                                              [self.prefill_dummy_row] * (empty + 1))):
                column += fill
        return entries

    def _page_lists(self, batch: Batch) -> _PageLists:
        ps = get_global_ctx().page_size
        kv_lens, ext, rows = (np.asarray(column, dtype=np.int64) for column in self._entries(batch))
        n = len(rows)
        num_pages = -(-kv_lens // ps)
        graph_prefill = batch.is_prefill and bool(batch.padded_tokens)
        static = (self.pg_meta if graph_prefill else
                  self.dg_meta if batch.is_decode and batch.padded_size in self.graph_wrappers else None)
        # qo_indptr, kv_indptr, last_page_len (n entries), rows (n), kv lengths (n): the host's math in numpy (a torch
        # op on host tensors costs several us of dispatch), one pinned buffer, one copy to the device (a graph's: the
        # whole static buffer its wrappers read, one contiguous block, from a pinned buffer kept for it)
        if static is None:
            host = torch.zeros(5, n + 1, dtype=torch.int32, pin_memory=pin(self.device))
            views = _HostViews(host, host[0], host[1], host[2, :n], host[4, :n], None, None, None, None)
        else:
            views = self._static_views(static, n)
            host = views.host
        a = host.numpy()  # (a static buffer's columns past n keep an earlier step's entries: nothing reads them)
        np.cumsum(ext, out=a[0, 1: n + 1])
        np.cumsum(num_pages, out=a[1, 1: n + 1])
        a[2, :n] = np.where(kv_lens > 0, (kv_lens - 1) % ps + 1, 0)  # 0: a graph prefill's empty entry
        a[3, :n] = rows
        a[4, :n] = kv_lens
        total = int(a[1, n])
        if static is None:
            dev = host.to(self.device, non_blocking=True)
            qo_dev, kv_indptr_dev, rows_dev = dev[0], dev[1], dev[3, :n]
        else:
            static.copy_(host, non_blocking=True)
            qo_dev, kv_indptr_dev, rows_dev = views.qo_indptr_device, views.kv_indptr_device, views.rows_device
        if graph_prefill:  # the graph gathers them (graph_prologue)
            indices = self.pg_indices[:total]
        elif self.own_kv(batch):  # an eager ragged prefill attends over the step's own K and V
            indices = None
        else:
            indices = page_ids(get_global_ctx().page_table, kv_indptr_dev, rows_dev, total, ps,
                               None if static is None else self.graph_indices)
        schedule = (n, tuple((kv_lens if self.use_tensor_cores else num_pages).tolist())) if batch.is_decode else ()
        return _PageLists(views.qo_indptr, views.kv_indptr, views.last_page_len, indices, qo_dev, schedule,
                          views.kv_lens)

    def _static_views(self, static: torch.Tensor, n: int) -> _HostViews:
        """The pinned host buffer of a static buffer's shape (one per shape, reused every step: a pinned allocation
        costs more host time than the lists' math; prepare_metadata waits for the last copy out of it before the
        next step writes it) and its views for n entries, made once per (shape, n) and static buffer."""
        key = (tuple(static.shape), n)
        views = self._host_views.get(key)
        if views is None or views.static is not static:
            host = views.host if views is not None else torch.zeros(
                static.shape, dtype=torch.int32, pin_memory=pin(self.device))
            views = _HostViews(host, host[0, : n + 1], host[1, : n + 1], host[2, :n], host[4, :n],
                               static, static[0, : n + 1], static[1], static[3, :n])
            self._host_views[key] = views
        return views

    def _plan_args(self, window_left: int, paged: bool = True) -> dict:
        args = dict(num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, window_left=window_left,
                    sm_scale=self.sm_scale, q_data_type=self.dtype, kv_data_type=self.dtype)
        return dict(args, page_size=get_global_ctx().page_size) if paged else args

    def prepare_metadata(self, batch: Batch) -> None:
        self.planned.synchronize()
        own = self.own_kv(batch)
        lists = self._page_lists(batch)
        graph = self.graph_wrappers.get(batch.padded_size) if batch.is_decode else None
        if batch.is_prefill and batch.padded_tokens:
            wrappers = self.prefill_graph[own]
            if own in self.prefill_graph_planned and self.plan_prefill_directly:
                for w, wrapper in wrappers.items():
                    self._fast_prefill_plan(wrapper, lists, w, own)
            else:
                # the first graph-mode plan (at the largest bucket) sizes the work arrays, and copies the lists
                # into the static buffers they are already in
                self._plan_prefill(wrappers, lists, own)
                self.prefill_graph_planned.add(own)
        elif batch.is_prefill:
            wrappers = self.ragged if own else self.prefill
            self._plan_prefill(wrappers, lists, own)
        elif graph is not None:
            wrappers = graph
            self._plan_graph(batch.padded_size, graph, lists)
        else:
            wrappers = self.decode
            self._plan_decode(wrappers, lists)
        self.planned.record(self.stream)
        batch.attn_metadata = self._metadata(batch, lists, wrappers, own)

    def _plan_prefill(self, wrappers: Dict[int, Any], lists: _PageLists, own: bool) -> None:
        """FlashInfer's full plan of prefill wrappers: ragged ones (own) over the entries' own tokens, whose kv
        offsets are their qo offsets, paged ones over their page lists."""
        for w, wrapper in wrappers.items():
            if own:
                wrapper.plan(lists.qo_indptr, lists.qo_indptr, head_dim_qk=self.head_dim, causal=True,
                             **self._plan_args(w, paged=False))
            else:
                wrapper.plan(lists.qo_indptr, lists.kv_indptr, lists.kv_indices, lists.last_page_len,
                             head_dim_qk=self.head_dim, causal=True, **self._plan_args(w))

    def _plan_decode(self, wrappers: Dict[int, Any], lists: _PageLists) -> None:
        for w, wrapper in wrappers.items():
            wrapper.plan(lists.kv_indptr, lists.kv_indices, lists.last_page_len, head_dim=self.head_dim,
                         **self._plan_args(w))

    def _fast_prefill_plan(self, wrapper: Any, lists: _PageLists, window_left: int, own: bool = False) -> None:
        """A graph-mode prefill plan for lists already in the wrapper's static buffers: what wrapper.plan does after
        its first call (the lengths run() reads, then the scheduler), without its host-side torch ops, copies and
        checks. A replay reads the new work arrays; the graph holds the rest. With FA3 the graph's prologue builds
        them (_sm90_layout); FA2's come from FlashInfer's scheduler. own: a ragged wrapper (kv offsets in tokens,
        the qo offsets: no cached prefix)."""
        n = len(lists.kv_lens)
        qo, kv_lens = lists.qo_indptr.numpy(), lists.kv_lens.numpy()
        # what run() checks and passes on (a capture records them)
        wrapper._qo_indptr_last, wrapper._max_q_len = int(qo[-1]), int(np.diff(qo).max())
        wrapper._max_kv_len = int(kv_lens.max())  # (its kv lengths' buffer is pg_meta's row: already copied)
        if self._sm90_layout(window_left, own) is not None:  # the graph's prologue schedules (graph_prologue)
            return
        args = [wrapper._float_workspace_buffer, wrapper._int_workspace_buffer,
                wrapper._pin_memory_int_workspace_buffer, lists.qo_indptr, lists.qo_indptr if own else lists.kv_indptr,
                lists.kv_lens, wrapper._max_total_num_rows, n, self.num_qo_heads, self.num_kv_heads,
                1 if own else get_global_ctx().page_size, True, self.head_dim, self.head_dim, True, window_left]
        if wrapper._backend == "fa2":
            args += [-1, False, 0]  # fixed_split_size, disable_split_kv, num_colocated_ctas: plan's defaults
        wrapper._plan_info = wrapper._cached_module.plan(*args)

    def _sm90_layout(self, window_left: int, own: bool = False) -> Tuple[List[int], int] | None:
        """The byte offsets of FA3's work arrays in the int workspace of the window's prefill graph wrapper of the
        kind (own: ragged) and how many items they hold, as its first plan laid them out (a graph-mode plan sizes
        them for the most work its entry and token counts allow, so every later plan has the same layout); None
        where FlashInfer's scheduler plans (FA2, a release other than the one these offsets follow, or one schedule
        for all heads: over 4096 tiles a head)."""
        key = own, window_left
        if key not in self._sm90:
            wrapper, layout = self.prefill_graph[own][window_left], None
            if wrapper._backend == "fa3" and self.plan_prefill_directly:
                info = [int(v) for v in wrapper._plan_info]
                layout = None if info[8] else (info[:8], (info[1] - info[0]) // 4)
            self._sm90[key] = layout
        return self._sm90[key]

    def _metadata(self, batch: Batch, lists: _PageLists, wrappers: Dict[int, Any],
                  own: bool = False) -> FlashInferMetadata:
        """cu_seqlens_q covers the batch's own requests (a graph prefill's empty and padding entries follow them):
        the LM head's rows."""
        return FlashInferMetadata(cu_seqlens_q=lists.qo_indptr_device[: batch.size + 1], wrappers=wrappers,
                                  own_kv=own)

    def _plan_graph(self, bs: int, wrappers: Dict[int, Any], lists: _PageLists) -> None:
        """Plan the graph for this batch, whose page lists _page_lists copied into the static buffers (every step: a
        row's next request has other pages), unless the last plan's schedule still holds for these page counts."""
        from flashinfer.decode import fast_decode_plan

        if self.graph_plan == lists.schedule:
            return
        self.graph_plan = lists.schedule
        for w, wrapper in wrappers.items():
            fast_decode_plan(wrapper, self.graph_indptr[: bs + 1], self.graph_indices[: len(lists.kv_indices)],
                             lists.last_page_len, head_dim=self.head_dim, global_override_indptr_cpu=lists.kv_indptr,
                             **self._plan_args(w))

    def forward(self, q: torch.Tensor, kv: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        md: FlashInferMetadata = batch.attn_metadata
        wrapper = md.wrappers[self.layer_window_left[layer_id]]
        if md.own_kv:  # K and V as strided views of the merged projection: the kernel takes their strides
            return wrapper.run(q, kv[:, 0], kv[:, 1], out=torch.empty_like(q)).view(q.shape[0], -1)
        kv_cache = get_global_ctx().kv_cache
        paged = (kv_cache.k_cache(layer_id), kv_cache.v_cache(layer_id))
        if batch.is_prefill:
            # every row belongs to an entry and is written, so the output needs none of the zeros FlashInfer's
            # prefill fills it with by default (one kernel a layer)
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            return wrapper.run(q, paged, out=out).view(q.shape[0], -1)
        return wrapper.run(q, paged).view(q.shape[0], -1)

    # ------------------------------------------------------------------ CUDA graphs (decode)
    def init_capture_graph(self, max_seq_len: int, bs_list: List[int]) -> None:
        max_bs = max(bs_list)
        max_pages = -(-max_seq_len // get_global_ctx().page_size)
        # the rows of _page_lists' host buffer, as pg_meta's: qo_indptr, kv_indptr, last_page_len, rows, kv lengths
        self.dg_meta = torch.zeros(5, max_bs + 1, dtype=torch.int32, device=self.device)
        self.graph_indices = torch.zeros(max_bs * max_pages, dtype=torch.int32, device=self.device)

    @property
    def graph_indptr(self) -> torch.Tensor:
        return self.dg_meta[1]

    @property
    def graph_last_page_len(self) -> torch.Tensor:
        return self.dg_meta[2]

    def prepare_for_capture(self, batch: Batch) -> None:
        """Create the size's wrappers (sharing the static buffers) and plan them fully once: capturing records
        the kernels their plan picked, and a graph-mode plan keeps those kernels valid for any later plan."""
        import flashinfer

        bs = batch.padded_size
        self.graph_wrappers[bs] = {w: flashinfer.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
            self.workspace, self.graph_indptr[: bs + 1], self.graph_indices, self.graph_last_page_len[:bs],
            kv_layout="NHD", use_tensor_cores=self.use_tensor_cores) for w in self.windows}
        self.planned.synchronize()
        lists = self._page_lists(batch)
        self._plan_decode(self.graph_wrappers[bs], lists)
        self.planned.record(self.stream)
        self.graph_plan = None
        batch.attn_metadata = self._metadata(batch, lists, self.graph_wrappers[bs])

    def prepare_for_replay(self, batch: Batch) -> None:
        """prepare_metadata already planned into the captured wrappers, whose buffers the graph reads."""
        if batch.is_prefill:
            assert batch.attn_metadata.wrappers is self.prefill_graph[self.own_kv(batch)]
        else:
            assert batch.attn_metadata.wrappers is self.graph_wrappers[batch.padded_size]

    # ------------------------------------------------------------------ CUDA graphs (prefill and extend)
    def graph_prologue(self, batch: Batch) -> None:
        """A paged prefill graph gathers its page ids from the page table at the rows and page offsets in pg_meta
        (one program an entry: the grid is the graph's fixed entry count); a prefill graph of either kind then
        builds FA3's work list from pg_meta's lengths into each wrapper's int workspace (one program)."""
        if batch.is_prefill:
            entries = self.prefill_graph_reqs + 1
            own = self.own_kv(batch)
            if not own:
                page_ids(get_global_ctx().page_table, self.pg_meta[1], self.pg_meta[3, :entries],
                         len(self.pg_indices), get_global_ctx().page_size, self.pg_indices)
            for w, wrapper in self.prefill_graph[own].items():
                layout = self._sm90_layout(w, own)
                if layout is not None:
                    sm90_schedule(self.pg_meta, entries, wrapper._int_workspace_buffer, layout[0], self.num_qo_heads,
                                  self.num_sms, self.head_dim, layout[1], ragged=own)

    def init_prefill_graphs(self, max_reqs: int, max_tokens: int, max_seq_len: int, dummy_row: int) -> None:
        """Static buffers for max_reqs requests plus the padding entry, and one graph-mode prefill wrapper per window
        over them, serving every token bucket: a graph-mode plan fixes the entry count and, at its first call (the
        largest bucket), the size of its work arrays, so every later plan writes the same device addresses. The
        kernels are the eager wrappers' (the module FlashInfer picks does not depend on graph mode). On sm90 the
        FA3 kernel runs a persistent grid over per-(query tile, head) work items, so its results are the eager
        ones; FA2 (other GPUs) always splits the keys in graph mode, which changes the summation order."""
        import flashinfer

        ps = get_global_ctx().page_size
        entries = max_reqs + 1
        int32 = dict(dtype=torch.int32, device=self.device)
        self.prefill_graph_reqs, self.prefill_dummy_row = max_reqs, dummy_row
        # the rows of _page_lists' host buffer: qo_indptr, kv_indptr, last_page_len, rows, kv lengths
        self.pg_meta = torch.zeros(5, entries + 1, **int32)
        self.pg_indices = torch.zeros(max_reqs * -(-max_seq_len // ps) + -(-max_tokens // ps), **int32)
        self.prefill_graph[False] = {w: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD", use_cuda_graph=True, qo_indptr_buf=self.pg_meta[0],
            paged_kv_indptr_buf=self.pg_meta[1], paged_kv_indices_buf=self.pg_indices,
            paged_kv_last_page_len_buf=self.pg_meta[2, :entries]) for w in self.windows}
        for wrapper in self.prefill_graph[False].values():  # the kv lengths run() reads: pg_meta's row, copied with it
            wrapper._kv_lens_buffer = self.pg_meta[4, :entries]
        if self.ragged_prefill:  # its kv offsets are the qo offsets (no cached prefix)
            self.prefill_graph[True] = {w: flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                self.workspace, kv_layout="NHD", use_cuda_graph=True, qo_indptr_buf=self.pg_meta[0],
                kv_indptr_buf=self.pg_meta[0]) for w in self.windows}
