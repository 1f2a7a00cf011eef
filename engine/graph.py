"""GraphRunner: CUDA graphs of decode steps (one per captured batch size) and of prefill and extend forwards (one per
token bucket), all sharing one memory pool.

Decode: a batch of n requests replays the graph of the smallest captured size >= n; the gap is filled with the
dummy request, whose page-table row points at the dummy page, so its KV writes never touch a real request.

Prefill and extend: a batch of at most prefill_max_reqs requests and n <= the largest bucket tokens replays the graph
of the smallest bucket T >= n. Its attention is FlashInfer's graph-mode paged prefill over the graph's static
buffers, which the host fills before each replay (the graph itself starts with the backend's graph_prologue: the page
ids and, with FA3, the work list), with a fixed number of entries: the requests, empty entries, and last a padding
entry that owns the T - n padding tokens, whose page list is the dummy page (their KV writes land there). Where the
backend has a ragged prefill, each bucket has a second graph, for batches without a cached prefix, whose attention
reads the step's own K and V (the padding entry's are its own tokens'). The graph ends at the final norm's hidden
states [T, H]; the LM head runs after the replay on the rows the batch asks for, with the shapes of the eager path.

Other batches, and every batch on a CPU, run eagerly.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any, Dict, List, Tuple

import numpy as np

import torch
from tqdm import tqdm

from engine.attention.base import AttentionBackend
from engine.core import Batch, Req, get_global_ctx
from engine.utils.device import is_cuda

logger = logging.getLogger(__name__)
SMALLEST_BUCKET = 128


def token_buckets(bound: int) -> List[int]:
    """The prefill graphs' token counts: 128, 256, 512, ... below bound, then bound itself (none for 0)."""
    out: List[int] = []
    t = SMALLEST_BUCKET
    while 0 < t < bound:
        out.append(t)
        t *= 2
    return out + [bound] if bound > 0 else out


class GraphRunner:
    def __init__(self, stream: Any, device: torch.device, model: torch.nn.Module, attn_backend: AttentionBackend,
                 cuda_graph_bs: List[int], dummy_req: Req, prefill_tokens: List[int] = (),
                 prefill_max_reqs: int = 1) -> None:
        self.device, self.model, self.dummy_req = device, model, dummy_req
        self.attn_backend = attn_backend
        self.graph_bs = sorted(cuda_graph_bs) if is_cuda(device) else []
        self.prefill_tokens = sorted(prefill_tokens) if is_cuda(device) else []
        self.prefill_max_reqs = prefill_max_reqs
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}  # decode, by batch size
        self.logits: Dict[int, torch.Tensor] = {}  # [bs, vocab] each
        # prefill / extend, by (token count, whether attention reads the step's own K and V: AttentionBackend.own_kv)
        self.prefill_graphs: Dict[Tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.hidden: Dict[Tuple[int, bool], torch.Tensor] = {}  # [T, H] each
        self.last_prefill: Tuple[int, bool] | None = None  # the key of the prefill graph replayed last
        self.input_views: Dict[int, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # static_inputs, by size
        self.memory_used = 0  # device bytes the captures took (pool, outputs, wrappers' buffers)
        if not (self.graph_bs or self.prefill_tokens):
            return
        size = max(self.max_graph_bs, self.max_prefill_tokens)
        self.dummy_slot = int(get_global_ctx().page_table[dummy_req.table_idx, 0])
        # The static inputs: the graph of size T reads ids [T] | positions [T] | slots [T] (int64) from the start of
        # one int32 block (each part 16-byte aligned), so that one host-to-device copy of that layout (stage_inputs)
        # fills all three, padding included. The graphs' layouts overlap: a step's inputs are written after the last
        # replay that reads the previous step's (one stream).
        self.block = torch.zeros(4 * _aligned(size), dtype=torch.int32, device=device)
        self.pad_positions = torch.arange(self.max_prefill_tokens, dtype=torch.int32, device=device)
        free_before = self._free_memory()
        # The prefill graphs first, largest first: the pool they size is reused by the smaller ones and by decode.
        pool = self._capture_prefill(stream)
        self._capture_decode(stream, pool)
        self.memory_used = free_before - self._free_memory()
        logger.info("captured %d decode graphs (bs %s) and %d prefill graphs (tokens %s) using %.1f MiB",
                    len(self.graphs), self.graph_bs, len(self.prefill_graphs), self.prefill_tokens,
                    self.memory_used / 2**20)

    def _free_memory(self) -> int:
        """Free device memory once the allocator's unused cache is returned (the warm-ups' eager activations), so
        that the difference is what the graphs keep."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0]

    @property
    def max_graph_bs(self) -> int:
        return self.graph_bs[-1] if self.graph_bs else 0

    @property
    def max_prefill_tokens(self) -> int:
        return self.prefill_tokens[-1] if self.prefill_tokens else 0

    # ------------------------------------------------------------------ capture
    def _capture_prefill(self, stream: Any) -> Any:
        if not self.prefill_tokens:
            return None
        ctx = get_global_ctx()
        self.attn_backend.init_prefill_graphs(self.prefill_max_reqs, self.max_prefill_tokens, ctx.page_table.shape[1],
                                         self.dummy_req.table_idx)
        pool = None
        kinds = (False, True) if self.attn_backend.ragged_prefill else (False,)
        for t, own in tqdm([(t, own) for t in reversed(self.prefill_tokens) for own in kinds],
                           desc="capturing prefill CUDA graphs", disable=None):  # None: drawn on a terminal only
            batch = Batch(reqs=[], phase="prefill")  # every token belongs to the padding entry
            batch.padded_reqs, batch.padded_tokens, batch.no_prefix = [], t, own
            self._load(batch, 0, t)
            # the first plan of each kind, at the largest t, sizes its wrappers' work arrays
            self.attn_backend.prepare_metadata(batch)
            with ctx.forward_batch(batch):
                self._prefill_forward(batch)  # warm-up: lazy allocations happen outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.hidden[t, own] = self._prefill_forward(batch)
            pool = graph.pool()
            self.prefill_graphs[t, own] = graph
        return pool

    def _prefill_forward(self, batch: Batch) -> torch.Tensor:
        self.attn_backend.graph_prologue(batch)
        return self.model.model(batch.input_ids)

    def _capture_decode(self, stream: Any, pool: Any) -> None:
        if not self.graph_bs:
            return
        ctx = get_global_ctx()
        self.attn_backend.init_capture_graph(ctx.page_table.shape[1], self.graph_bs)
        # Largest first, so the smaller graphs reuse the pool the largest one sized.
        for bs in tqdm(reversed(self.graph_bs), total=len(self.graph_bs), desc="capturing decode CUDA graphs",
                       disable=None):
            batch = Batch(reqs=[self.dummy_req] * bs, phase="decode")
            batch.padded_reqs = batch.reqs
            self._load(batch, 0, bs)
            self.attn_backend.prepare_for_capture(batch)
            with ctx.forward_batch(batch):
                self.model.forward()  # warm-up
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[bs] = self.model.forward()
            pool = graph.pool()
            self.graphs[bs] = graph

    # ------------------------------------------------------------------ use
    def can_use_cuda_graph(self, batch: Batch) -> bool:
        return self.replays(batch) > 0

    def pad_batch(self, batch: Batch) -> None:
        """Fill batch.padded_reqs (a decode batch padded with the dummy request up to a captured size),
        batch.padded_tokens (a prefill batch's graph bucket, 0 when it runs eagerly) and batch.no_prefix."""
        n = batch.size
        batch.padded_reqs, batch.padded_tokens = list(batch.reqs), 0
        batch.no_prefix = batch.is_prefill and all(r.cached_len == 0 for r in batch.reqs)
        if batch.is_decode and 0 < n <= self.max_graph_bs:
            size = self.graph_bs[bisect.bisect_left(self.graph_bs, n)]
            batch.padded_reqs += [self.dummy_req] * (size - n)
        elif batch.is_prefill and 0 < n <= self.prefill_max_reqs:
            batch.padded_tokens = self.prefill_bucket(sum(r.extend_len for r in batch.reqs))

    def prefill_bucket(self, tokens: int) -> int:
        """The prefill graph a batch of this many tokens replays: the smallest bucket >= tokens (0: none, eager)."""
        if tokens > self.max_prefill_tokens:
            return 0
        return self.prefill_tokens[bisect.bisect_left(self.prefill_tokens, tokens)]

    def replay(self, batch: Batch) -> torch.Tensor:
        """Copy the batch into the static buffers and replay. Decode: logits [padded_bs, vocab]; prefill: the
        logits the eager forward returns (the LM head runs after the replay on the batch's own rows)."""
        self.attn_backend.prepare_for_replay(batch)
        n = len(batch.input_ids)
        if batch.is_prefill:
            key = self.last_prefill = batch.padded_tokens, self.attn_backend.own_kv(batch)
            self._load(batch, n, key[0])
            self.prefill_graphs[key].replay()
            return self.model.logits(self.hidden[key][:n], batch)
        bs = batch.padded_size
        self._load(batch, n, bs)
        self.graphs[bs].replay()
        return self.logits[bs]

    def static_inputs(self, size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The views the graph of this size reads: input ids, positions (int32) and KV slots (int64), made once a size
        (each view op costs host time before every launch)."""
        views = self.input_views.get(size)
        if views is None:
            views = self.input_views[size] = _input_views(self.block, size)
        return views

    def replays(self, batch: Batch) -> int:
        """The size of the graph a padded batch replays (its bucket or padded batch size), 0 when it runs eagerly."""
        if batch.is_prefill:
            return batch.padded_tokens if (batch.padded_tokens, False) in self.prefill_graphs else 0
        return batch.padded_size if batch.is_decode and batch.padded_size in self.graphs else 0

    def host_inputs(self, batch: Batch, n: int, pin_memory: bool) -> Tuple[torch.Tensor, np.ndarray, np.ndarray,
                                                                          np.ndarray]:
        """A host int32 buffer for a batch of n tokens laid out as the device inputs it is copied to (ids |
        positions | slots as int64), and numpy views of its first n ids, positions and slots for the caller to
        fill. For a batch that replays a graph of size T > n the layout is the graph's, its padding filled here:
        id 0, positions 0, 1, ... (prefill: the padding entry's sequence) or 0 (decode), the dummy slot."""
        size = self.replays(batch) or n
        host = torch.empty(4 * _aligned(size), dtype=torch.int32, pin_memory=pin_memory)
        ids, pos, slots = _input_views(host.numpy(), size)
        if size > n:
            ids[n:] = 0
            pos[n:] = np.arange(size - n) if batch.is_prefill else 0
            slots[n:] = self.dummy_slot
        return host, ids[:n], pos[:n], slots[:n]

    def stage_inputs(self, batch: Batch, host: torch.Tensor, n: int) -> None:
        """host_inputs' buffer to the device in one copy, straight into the static inputs of the graph the batch
        replays (replay then copies nothing), else into a new tensor; batch.input_ids / positions / out_loc are
        set to its first n rows."""
        size = self.replays(batch)
        if size:
            self.block[: host.shape[0]].copy_(host, non_blocking=True)
            views = self.static_inputs(size)
        else:
            views = _input_views(host.to(self.device, non_blocking=True), n)
        batch.input_ids, batch.positions, batch.out_loc = _first(views, n)

    def gather_decode_inputs(self, batch: Batch, flat: torch.Tensor, positions: torch.Tensor,
                             token_pool: torch.Tensor) -> None:
        """A decode batch's inputs from the device: its ids from token_pool and its KV slots from the page table at
        the flat indices (row * width + position) of each request's last position, and its positions. For a graph
        batch one kernel writes them into the graph's static inputs, padding included; else two gathers."""
        page_table = get_global_ctx().page_table
        size = self.replays(batch)
        if size:  # (graphs exist only on CUDA, where Triton is)
            from engine.kernels.graph_inputs import gather_decode_inputs

            views = self.static_inputs(size)
            gather_decode_inputs(flat, positions, token_pool, page_table, *views, self.dummy_slot)
            batch.input_ids, batch.positions, batch.out_loc = _first(views, flat.shape[0])
            return
        batch.input_ids = token_pool.view(-1).index_select(0, flat)
        batch.out_loc = page_table.view(-1).index_select(0, flat)  # int32 (converted when used)
        batch.positions = positions

    def _load(self, batch: Batch, n: int, size: int) -> None:
        """The batch's n tokens into the static inputs, padding up to size: id 0, the dummy slot, and positions 0
        (decode: each padding request holds one token) or 0, 1, ... (prefill: the padding entry's own sequence).
        Nothing to do where stage_inputs or gather_decode_inputs already wrote them there, padding included.
        During capture (n = 0) the batch is pointed at the static buffers."""
        input_ids, positions, out_loc = self.static_inputs(size)
        if n == 0:
            batch.input_ids, batch.positions, batch.out_loc = input_ids, positions, out_loc
        elif batch.input_ids.data_ptr() == input_ids.data_ptr():
            return
        else:
            input_ids[:n].copy_(batch.input_ids)
            positions[:n].copy_(batch.positions)
            out_loc[:n].copy_(batch.out_loc)
        if n == size:  # nothing to pad (each op below costs host time even on an empty slice)
            return
        input_ids[n:].zero_()
        if batch.is_prefill:
            positions[n:].copy_(self.pad_positions[: size - n])
        else:
            positions[n:].zero_()
        out_loc[n:].fill_(self.dummy_slot)

    def destroy(self) -> None:
        self.graphs.clear()
        self.logits.clear()
        self.prefill_graphs.clear()
        self.hidden.clear()


def _aligned(size: int) -> int:
    """size rounded up to 4 int32s: each part of the static inputs starts 16-byte aligned."""
    return -(-size // 4) * 4


def _input_views(block: Any, size: int) -> Tuple[Any, Any, Any]:
    """ids [size] | positions [size] | slots [size] int64 in an int32 block (a tensor, or a host buffer's numpy
    array), each part 16-byte aligned."""
    r = _aligned(size)
    slots = block[2 * r: 2 * r + 2 * size]
    return block[:size], block[r: r + size], slots.view(np.int64 if isinstance(block, np.ndarray) else torch.int64)


def _first(views: Tuple[torch.Tensor, ...], n: int) -> Tuple[torch.Tensor, ...]:
    """The first n rows of each view: the views themselves when they hold n (no view op, which costs host time)."""
    return views if len(views[0]) == n else tuple(v[:n] for v in views)
