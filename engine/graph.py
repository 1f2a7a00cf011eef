"""GraphRunner: decode CUDA graphs, one per captured batch size, sharing one memory pool.

A decode batch of n requests replays the graph of the smallest captured size >= n; the gap is filled with the
dummy request, whose page-table row points at the dummy page, so its KV writes never touch a real request.
Batches above the largest size, prefill batches and CPU batches run eagerly.
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


class GraphRunner:
    def __init__(self, stream: Any, device: torch.device, model: torch.nn.Module, attn_backend: AttentionBackend,
                 cuda_graph_bs: List[int], dummy_req: Req) -> None:
        self.device = device
        self.dummy_req = dummy_req
        self.attn_backend = attn_backend
        self.graph_bs = sorted(cuda_graph_bs) if is_cuda(device) else []
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: Dict[int, torch.Tensor] = {}
        if not self.graph_bs:
            return
        max_bs = self.graph_bs[-1]
        self.dummy_slot = int(get_global_ctx().page_table[dummy_req.table_idx, 0])
        self.input_ids = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.out_loc = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self._capture(stream, model, attn_backend)

    @property
    def max_graph_bs(self) -> int:
        return self.graph_bs[-1] if self.graph_bs else 0

    def _capture(self, stream: Any, model: torch.nn.Module, attn_backend: AttentionBackend) -> None:
        ctx = get_global_ctx()
        attn_backend.init_capture_graph(ctx.page_table.shape[1], self.graph_bs)
        self.out_loc.fill_(self.dummy_slot)
        pool = None
        free_before = torch.cuda.mem_get_info(self.device)[0]
        # Largest first, so the smaller graphs reuse the pool the largest one sized.
        for bs in tqdm(reversed(self.graph_bs), total=len(self.graph_bs), desc="capturing decode CUDA graphs"):
            batch = Batch(reqs=[self.dummy_req] * bs, phase="decode")
            batch.padded_reqs = batch.reqs
            batch.input_ids, batch.positions, batch.out_loc = self.input_ids[:bs], self.positions[:bs], self.out_loc[:bs]
            attn_backend.prepare_for_capture(batch)
            with ctx.forward_batch(batch):
                model.forward()  # warm-up: lazy allocations and kernel selection happen outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[bs] = model.forward()
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("captured %d decode graphs (bs %s) using %.1f MiB", len(self.graphs), self.graph_bs, used / 2**20)

    def can_use_cuda_graph(self, batch: Batch) -> bool:
        return batch.is_decode and batch.padded_size in self.graphs

    def pad_batch(self, batch: Batch) -> None:
        """Fill batch.padded_reqs: the batch itself, or padded with the dummy request up to a captured size."""
        n = batch.size
        if batch.is_decode and 0 < n <= self.max_graph_bs:
            size = self.graph_bs[bisect.bisect_left(self.graph_bs, n)]
            batch.padded_reqs = batch.reqs + [self.dummy_req] * (size - n)
        else:
            batch.padded_reqs = list(batch.reqs)

    def replay(self, batch: Batch) -> torch.Tensor:
        """Copy the batch into the static buffers, replay, return logits [padded_bs, vocab]."""
        n, bs = batch.size, batch.padded_size
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.out_loc[:n].copy_(batch.out_loc)
        self.input_ids[n:bs].zero_()
        self.positions[n:bs].zero_()
        self.out_loc[n:bs].fill_(self.dummy_slot)
        self.attn_backend.prepare_for_replay(batch)
        self.graphs[bs].replay()
        return self.logits[bs]

    def destroy(self) -> None:
        self.graphs.clear()
        self.logits.clear()
