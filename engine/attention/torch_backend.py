"""Reference attention in plain torch over the paged pool: any device, any dtype, any page size.

Each request's K/V is gathered from its page-table row into a padded [B, Hkv, Lk, D] block and attended with
SDPA under an explicit mask: key j is visible to query i when j <= cached_len + i, and on a sliding layer also
when (cached_len + i) - j < window (HF's rule: the query's own key and window - 1 before it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, BaseAttnMetadata, layer_windows
from engine.core import Batch, get_global_ctx
from engine.models.config import ModelConfig


@dataclass
class TorchAttnMetadata(BaseAttnMetadata):
    kv_slots: torch.Tensor  # [B, Lk] int64 token slots (0 where padded)
    q_index: torch.Tensor  # [B, Lq] int64 row into the packed tokens (0 where padded)
    q_valid: torch.Tensor  # [B, Lq] bool
    masks: dict  # window (None = full) -> [B, 1, Lq, Lk] bool, True = attend


class TorchBackend(AttentionBackend):
    def __init__(self, config: ModelConfig) -> None:
        self.windows = layer_windows(config)
        self.scale = config.attn_scale  # None: SDPA's 1 / sqrt(head_dim)

    def prepare_metadata(self, batch: Batch) -> None:
        ctx = get_global_ctx()
        reqs = batch.padded_reqs
        device = ctx.page_table.device
        ext = torch.tensor([r.extend_len for r in reqs])
        cached = torch.tensor([r.cached_len for r in reqs])
        kv_len = cached + ext
        lq, lk = int(ext.max()), int(kv_len.max())
        cu = torch.zeros(len(reqs) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(ext, 0)
        rows = torch.tensor([r.table_idx for r in reqs])
        kpos = torch.arange(lk)
        qi = torch.arange(lq)
        kv_valid = kpos[None, :] < kv_len[:, None]  # [B, Lk]
        q_valid = qi[None, :] < ext[:, None]  # [B, Lq]
        qpos = cached[:, None] + qi[None, :]  # [B, Lq]
        causal = (kpos[None, None, :] <= qpos[:, :, None]) & kv_valid[:, None, :]
        masks = {}
        for window in set(self.windows):
            mask = causal if window is None else causal & (qpos[:, :, None] - kpos[None, None, :] < window)
            mask = mask | (~q_valid[:, :, None] & (kpos == 0))  # padded queries see key 0 so softmax stays finite
            masks[window] = mask.unsqueeze(1).to(device)
        page_table = ctx.page_table[rows.to(device), :lk].long()
        batch.attn_metadata = TorchAttnMetadata(
            cu_seqlens_q=cu.to(device),
            kv_slots=torch.where(kv_valid.to(device), page_table, 0),
            q_index=torch.where(q_valid, cu[:-1, None] + qi[None, :], 0).to(device),
            q_valid=q_valid.to(device),
            masks=masks,
        )

    def forward(self, q: torch.Tensor, kv: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        kv_cache = get_global_ctx().kv_cache
        md: TorchAttnMetadata = batch.attn_metadata
        mask = md.masks[self.windows[layer_id]]
        n, hq, d = q.shape
        k_slots, v_slots = kv_cache.slots(layer_id)
        hkv = k_slots.shape[1]
        bsz, lk = md.kv_slots.shape
        slots = md.kv_slots.flatten()  # index_select: far cheaper than advanced indexing on a CPU
        keys = k_slots.index_select(0, slots).view(bsz, lk, hkv, d)
        values = v_slots.index_select(0, slots).view(bsz, lk, hkv, d)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hkv, Lk, D]
        if batch.is_decode:  # one query per request, already in order: no gather, no scatter back
            out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=self.scale,
                                                 enable_gqa=hq != hkv)
            return out.reshape(n, hq * d)
        queries = q[md.q_index].transpose(1, 2)  # [B, Hq, Lq, D]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale,
                                             enable_gqa=hq != hkv)
        return out.transpose(1, 2)[md.q_valid].reshape(n, hq * d)  # back to packed [N, Hq * D]
