"""Reference attention in plain torch over the paged pool: any device, any dtype, any page size.

Each request's K/V is gathered from its page-table row into a padded [B, Hkv, Lk, D] block and attended with
SDPA under an explicit mask: key j is visible to query i when j <= cached_len + i, and on a sliding layer also
when (cached_len + i) - j < window (HF's rule: the query's own key and window - 1 before it).

A prefill of prompts without a cached prefix (batch.no_prefix) needs none of that: each prompt attends over its own
K and V, which the step computed (forward's kv), with SDPA's causal mask, whose CPU kernel skips the key blocks above
the diagonal that an explicit mask makes it compute (SmolLM2's heads at 2048 tokens: 78 ms a layer against 142, one
thread). On a sliding layer the prompt outgrows, its queries go in blocks of PROMPT_BLOCK, each over the keys its
window reaches, under that block's mask: a mask over the whole prompt makes the kernel compute every key block
(gemma3-270m's heads at 2048 tokens, window 512: 77 ms a layer against 212).

Any other prefill batch of several requests is attended in blocks: its one-token extends (running requests
decoding beside a prompt's chunk) together, every longer extend on its own. Padded to the longest, a decode row costs
as much as a 1,000-token chunk, and a 64-token prompt as much as a 1,000-token one.

Padding every request to the batch's longest changes the lengths SDPA sums each query's keys over, and so a
request's bits with its batch: in batch-invariant mode (per_request) each request is attended on its own, over
exactly its own keys, one SDPA call each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

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


PROMPT_BLOCK = 256  # queries of a sliding layer's prompt attended in one call


@dataclass
class BlocksMetadata(BaseAttnMetadata):
    blocks: List[TorchAttnMetadata]  # each over some of the requests, padded among them
    rows: List[torch.Tensor]  # [tokens of the block] int64: where each block's tokens are in the packed batch


@dataclass
class PromptMetadata(BaseAttnMetadata):
    """A prefill of prompts without a cached prefix: each attends over its own rows of the step's packed q and kv.
    window -> a layer's SDPA calls: (first query row, end row, first key row, mask [1, 1, queries, keys] bool, or
    None for SDPA's causal mask over rows [first query row, end row))."""

    blocks: dict


@dataclass
class RequestAttn:
    """One request's attention in per-request mode."""

    start: int  # its tokens are rows [start, end) of the packed batch
    end: int
    kv_start: int  # its keys are rows [kv_start, kv_end) of the batch's gathered keys, exactly its own
    kv_end: int
    masks: dict  # window -> [1, 1, Lq, Lk] bool, or None where every key is visible


@dataclass
class PerRequestMetadata(BaseAttnMetadata):
    requests: List[RequestAttn]
    kv_slots: torch.Tensor  # [sum of Lk] int64: every request's key slots, one after another (one gather a layer)


def visible(qpos: torch.Tensor, kpos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Whether the key at kpos is visible to the query at qpos (broadcast): HF's causal rule, and on a sliding layer
    the query's own key and window - 1 before it."""
    mask = kpos <= qpos
    return mask if window is None else mask & (qpos - kpos < window)


def prompt_blocks(start: int, end: int, window: int | None, device: torch.device) -> list:
    """The SDPA calls of a prompt at rows [start, end) on a layer (PromptMetadata.blocks): one under the causal mask
    where its window cuts nothing, else blocks of PROMPT_BLOCK queries, each over the keys its window reaches (from
    window - 1 before its first query to its last) under its own mask."""
    if window is None or end - start <= window:
        return [(start, end, start, None)]
    out = []
    for q0 in range(start, end, PROMPT_BLOCK):
        q1, k0 = min(end, q0 + PROMPT_BLOCK), max(start, q0 - window + 1)
        mask = visible(torch.arange(q0, q1)[:, None], torch.arange(k0, q1)[None, :], window)
        out.append((q0, q1, k0, mask[None, None].to(device)))
    return out


class TorchBackend(AttentionBackend):
    def __init__(self, config: ModelConfig, per_request: bool = False) -> None:
        self.windows = layer_windows(config)
        self.scale = config.attn_scale  # None: SDPA's 1 / sqrt(head_dim)
        self.per_request = per_request

    def prepare_metadata(self, batch: Batch) -> None:
        if self.per_request:
            return self._prepare_per_request(batch)
        if batch.no_prefix:
            return self._prepare_prompts(batch)
        reqs = batch.padded_reqs
        cu = torch.zeros(len(reqs) + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(torch.tensor([r.extend_len for r in reqs]), 0)
        ones = [i for i, r in enumerate(reqs) if r.extend_len == 1]
        groups = ([ones] if ones else []) + [[i] for i, r in enumerate(reqs) if r.extend_len > 1]
        if not batch.is_prefill or len(groups) == 1:
            batch.attn_metadata = self._block(reqs, cu[:-1])
            return
        device = get_global_ctx().page_table.device
        blocks, rows = [], []
        for group in groups:
            starts = cu[group]
            blocks.append(self._block([reqs[i] for i in group], starts))
            rows.append(torch.cat([torch.arange(int(a), int(b)) for a, b in zip(starts, cu[[i + 1 for i in group]])])
                        .to(device))
        batch.attn_metadata = BlocksMetadata(cu_seqlens_q=cu.to(torch.int32).to(device), blocks=blocks, rows=rows)

    def _block(self, reqs: List, starts: torch.Tensor) -> TorchAttnMetadata:
        """The padded block of these requests, whose tokens start at rows `starts` of the packed batch."""
        device = get_global_ctx().page_table.device
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
        masks = {}
        for window in set(self.windows):
            mask = visible(qpos[:, :, None], kpos[None, None, :], window) & kv_valid[:, None, :]
            mask = mask | (~q_valid[:, :, None] & (kpos == 0))  # padded queries see key 0 so softmax stays finite
            masks[window] = mask.unsqueeze(1).to(device)
        page_table = get_global_ctx().page_table[rows.to(device), :lk].long()
        return TorchAttnMetadata(
            cu_seqlens_q=cu.to(device),
            kv_slots=torch.where(kv_valid.to(device), page_table, 0),
            q_index=torch.where(q_valid, starts[:, None] + qi[None, :], 0).to(device),
            q_valid=q_valid.to(device),
            masks=masks,
        )

    def _prepare_prompts(self, batch: Batch) -> None:
        device = get_global_ctx().page_table.device
        cu = [0]
        for r in batch.padded_reqs:
            cu.append(cu[-1] + r.extend_len)
        blocks = {window: [b for start, end in zip(cu[:-1], cu[1:]) for b in prompt_blocks(start, end, window, device)]
                  for window in set(self.windows)}
        batch.attn_metadata = PromptMetadata(cu_seqlens_q=torch.tensor(cu, dtype=torch.int32).to(device),
                                             blocks=blocks)

    def _prepare_per_request(self, batch: Batch) -> None:
        page_table = get_global_ctx().page_table
        cu, kv_cu, requests, slots = [0], [0], [], []
        for r in batch.padded_reqs:
            lk = r.cached_len + r.extend_len
            cu.append(cu[-1] + r.extend_len)
            kv_cu.append(kv_cu[-1] + lk)
            qpos = torch.arange(r.cached_len, lk)[:, None]
            kpos = torch.arange(lk)[None, :]
            masks = {}
            for window in set(self.windows):
                mask = visible(qpos, kpos, window)
                masks[window] = None if bool(mask.all()) else mask[None, None].to(page_table.device)
            requests.append(RequestAttn(cu[-2], cu[-1], kv_cu[-2], kv_cu[-1], masks))
            slots.append(page_table[r.table_idx, :lk])
        batch.attn_metadata = PerRequestMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32).to(page_table.device), requests=requests,
            kv_slots=torch.cat(slots).long())

    def forward(self, q: torch.Tensor, kv: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        k_slots, v_slots = get_global_ctx().kv_cache.slots(layer_id)
        if isinstance(batch.attn_metadata, PerRequestMetadata):
            return self._forward_per_request(q, k_slots, v_slots, self.windows[layer_id], batch.attn_metadata)
        if isinstance(batch.attn_metadata, PromptMetadata):
            return self._forward_prompts(q, kv, self.windows[layer_id], batch.attn_metadata)
        if isinstance(batch.attn_metadata, BlocksMetadata):
            out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
            for md, rows in zip(batch.attn_metadata.blocks, batch.attn_metadata.rows):
                out[rows] = self._forward_block(q, k_slots, v_slots, layer_id, md, False)
            return out
        return self._forward_block(q, k_slots, v_slots, layer_id, batch.attn_metadata, batch.is_decode)

    def _forward_block(self, q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, layer_id: int,
                       md: TorchAttnMetadata, decode: bool) -> torch.Tensor:
        """[tokens of the block, Hq * D], in the block's order (the packed batch's when it holds every request)."""
        mask = md.masks[self.windows[layer_id]]
        n, hq, d = q.shape
        hkv = k_slots.shape[1]
        bsz, lk = md.kv_slots.shape
        slots = md.kv_slots.flatten()  # index_select: far cheaper than advanced indexing on a CPU
        keys = k_slots.index_select(0, slots).view(bsz, lk, hkv, d)
        values = v_slots.index_select(0, slots).view(bsz, lk, hkv, d)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hkv, Lk, D]
        if decode:  # one query per request, already in order: no gather, no scatter back
            out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=self.scale,
                                                 enable_gqa=hq != hkv)
            return out.reshape(n, hq * d)
        queries = q[md.q_index].transpose(1, 2)  # [B, Hq, Lq, D]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale,
                                             enable_gqa=hq != hkv)
        return out.transpose(1, 2)[md.q_valid].reshape(-1, hq * d)  # back to packed [N, Hq * D]

    def _forward_prompts(self, q: torch.Tensor, kv: torch.Tensor, window: int | None,
                         md: PromptMetadata) -> torch.Tensor:
        n, hq, d = q.shape
        gqa = hq != kv.shape[2]
        out = q.new_empty(n, hq * d)
        for q0, q1, k0, mask in md.blocks[window]:
            queries = q[q0: q1].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]: strided views
            keys, values = (kv[k0: q1, i].transpose(0, 1).unsqueeze(0) for i in (0, 1))
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, is_causal=mask is None,
                                               scale=self.scale, enable_gqa=gqa)
            out[q0: q1] = o[0].transpose(0, 1).reshape(q1 - q0, hq * d)
        return out

    def _forward_per_request(self, q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                             window: int | None, md: PerRequestMetadata) -> torch.Tensor:
        n, hq, d = q.shape
        gqa = hq != k_slots.shape[1]
        out = q.new_empty(n, hq * d)
        all_keys, all_values = k_slots.index_select(0, md.kv_slots), v_slots.index_select(0, md.kv_slots)
        for r in md.requests:
            keys = all_keys[r.kv_start: r.kv_end].transpose(0, 1).unsqueeze(0)  # [1, Hkv, Lk, D]
            values = all_values[r.kv_start: r.kv_end].transpose(0, 1).unsqueeze(0)
            queries = q[r.start: r.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=r.masks[window], scale=self.scale,
                                               enable_gqa=gqa)
            out[r.start: r.end] = o[0].transpose(0, 1).reshape(r.end - r.start, hq * d)
        return out
