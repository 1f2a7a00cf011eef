"""GraphRunner: CUDA graphs of decode steps (one per captured batch size) and of prefill and extend forwards (one per
token bucket), all sharing one memory pool.

Decode: a batch of n requests replays the graph of the smallest captured size >= n; the gap is filled with the
dummy request, whose page-table row points at the dummy page, so its KV writes never touch a real request.

Prefill and extend: a batch of at most prefill_max_reqs requests and n <= the largest bucket tokens replays the graph
of the smallest bucket T >= n. Its attention is FlashInfer's graph-mode paged prefill over the graph's static
buffers, which the host fills before each replay (the graph itself starts with the backend's graph_prologue: the page
ids and, with FA3, the work list), with a fixed number of entries: the requests, empty entries, and last a padding
entry that owns the T - n padding tokens, whose page list is the dummy page (their KV writes land there). The graph
ends at the final norm's hidden states [T, H]; the LM head runs after the replay on the rows the batch asks for, with
the shapes of the eager path.

Other batches, and every batch on a CPU, run eagerly.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any, Dict, List

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
        self.prefill_graphs: Dict[int, torch.cuda.CUDAGraph] = {}  # prefill / extend, by token count
        self.hidden: Dict[int, torch.Tensor] = {}  # [T, H] each
        self.memory_used = 0  # device bytes the captures took (pool, outputs, wrappers' buffers)
        if not (self.graph_bs or self.prefill_tokens):
            return
        size = max(self.max_graph_bs, self.max_prefill_tokens)
        self.dummy_slot = int(get_global_ctx().page_table[dummy_req.table_idx, 0])
        self.input_ids = torch.zeros(size, dtype=torch.int32, device=device)
        self.positions = torch.zeros(size, dtype=torch.int32, device=device)
        self.out_loc = torch.full((size,), self.dummy_slot, dtype=torch.int64, device=device)
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
        for t in tqdm(reversed(self.prefill_tokens), total=len(self.prefill_tokens),
                      desc="capturing prefill CUDA graphs"):
            batch = Batch(reqs=[], phase="prefill")  # every token belongs to the padding entry
            batch.padded_reqs, batch.padded_tokens = [], t
            self._load(batch, 0, t)
            # the first plan, at the largest t, sizes the wrappers' work arrays
            self.attn_backend.prepare_metadata(batch)
            with ctx.forward_batch(batch):
                self._prefill_forward(batch)  # warm-up: lazy allocations happen outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.hidden[t] = self._prefill_forward(batch)
            pool = graph.pool()
            self.prefill_graphs[t] = graph
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
        for bs in tqdm(reversed(self.graph_bs), total=len(self.graph_bs), desc="capturing decode CUDA graphs"):
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
        if batch.is_prefill:
            return batch.padded_tokens in self.prefill_graphs
        return batch.is_decode and batch.padded_size in self.graphs

    def pad_batch(self, batch: Batch) -> None:
        """Fill batch.padded_reqs (a decode batch padded with the dummy request up to a captured size) and
        batch.padded_tokens (a prefill batch's graph bucket, 0 when it runs eagerly)."""
        n = batch.size
        batch.padded_reqs, batch.padded_tokens = list(batch.reqs), 0
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
            t = batch.padded_tokens
            self._load(batch, n, t)
            self.prefill_graphs[t].replay()
            return self.model.logits(self.hidden[t][:n], batch)
        bs = batch.padded_size
        self._load(batch, n, bs)
        self.graphs[bs].replay()
        return self.logits[bs]

    def _load(self, batch: Batch, n: int, size: int) -> None:
        """The batch's n tokens into the static inputs, padding up to size: id 0, the dummy slot, and positions 0
        (decode: each padding request holds one token) or 0, 1, ... (prefill: the padding entry's own sequence).
        During capture (n = 0) the batch is pointed at the static buffers."""
        if n:
            self.input_ids[:n].copy_(batch.input_ids)
            self.positions[:n].copy_(batch.positions)
            self.out_loc[:n].copy_(batch.out_loc)
        else:
            batch.input_ids, batch.positions = self.input_ids[:size], self.positions[:size]
            batch.out_loc = self.out_loc[:size]
        if n == size:  # nothing to pad (each op below costs host time even on an empty slice)
            return
        self.input_ids[n:size].zero_()
        if batch.is_prefill:
            self.positions[n:size].copy_(self.pad_positions[: size - n])
        else:
            self.positions[n:size].zero_()
        self.out_loc[n:size].fill_(self.dummy_slot)

    def destroy(self) -> None:
        self.graphs.clear()
        self.logits.clear()
        self.prefill_graphs.clear()
        self.hidden.clear()
