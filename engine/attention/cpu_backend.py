"""Attention on the CPU in fp32: every batch (prompts, chunks over a cached prefix, decodes, any mix) in one call of
the paged kernel a layer (kernels/cpu_kernels.py), which reads K and V in place through the page table. No padded
copy of the keys, no mask tensor, no per-request Python in the layer: the metadata is one [B, 4] table a step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend, BaseAttnMetadata, layer_windows
from engine.core import Batch, get_global_ctx
from engine.kernels import cpu_kernels
from engine.models.config import ModelConfig


@dataclass
class CpuAttnMetadata(BaseAttnMetadata):
    reqs: torch.Tensor  # [B, 4] int64: first query row, queries, page-table row, cached keys


class CpuBackend(AttentionBackend):
    def __init__(self, config: ModelConfig) -> None:
        self.windows = layer_windows(config)
        self.scale = config.attn_scale if config.attn_scale is not None else config.head_dim ** -0.5

    def prepare_metadata(self, batch: Batch) -> None:
        reqs = batch.padded_reqs
        table = torch.tensor([[0, r.extend_len, r.table_idx, r.cached_len] for r in reqs], dtype=torch.int64)
        cu = torch.zeros(len(reqs) + 1, dtype=torch.int64)
        torch.cumsum(table[:, 1], 0, out=cu[1:])
        table[:, 0] = cu[:-1]
        batch.attn_metadata = CpuAttnMetadata(cu_seqlens_q=cu.to(torch.int32), reqs=table)

    def forward(self, q: torch.Tensor, kv: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        ctx = get_global_ctx()
        k_slots, v_slots = ctx.kv_cache.slots(layer_id)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        cpu_kernels.attend(q, k_slots, v_slots, ctx.page_table, batch.attn_metadata.reqs, self.windows[layer_id],
                             self.scale, out)
        return out
