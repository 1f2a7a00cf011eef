"""The attention layer: the per-head q/k norms, RoPE and the KV store (one op of the engine's ops, one kernel on the
fused path), then the backend, which attends over the pool (or, for a prompt, over the step's own K and V)."""

from __future__ import annotations

import torch
from torch import nn

from engine.core import get_global_ctx
from engine.layers.ops import TorchOps
from engine.layers.rotary import RotaryEmbedding


class AttentionLayer(nn.Module):
    def __init__(self, layer_id: int, rotary: RotaryEmbedding, ops: TorchOps) -> None:
        super().__init__()
        self.layer_id, self.ops = layer_id, ops
        self.rotary = [rotary]  # a list, so the shared module is neither re-registered nor in the state dict

    def forward(self, q: torch.Tensor, kv: torch.Tensor, norms: tuple | None) -> torch.Tensor:
        """q [N, Hq, D] and kv [N, 2, Hkv, D] (views of the merged projection); norms: the (q_norm, k_norm) RMSNorm
        modules, or None -> [N, Hq * D]."""
        ctx = get_global_ctx()
        batch = ctx.batch
        self.ops.qk_rope_store_(batch.positions, q, kv, self.rotary[0].table, norms, ctx.kv_cache, self.layer_id,
                                batch.out_loc)
        return ctx.attn_backend.forward(q, kv, self.layer_id, batch)
