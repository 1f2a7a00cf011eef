"""The attention layer: RoPE on q and k in place, then the backend, which stores k and v in the pool and attends."""

from __future__ import annotations

import torch
from torch import nn

from engine.core import get_global_ctx
from engine.layers.rotary import RotaryEmbedding


class AttentionLayer(nn.Module):
    def __init__(self, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.rotary = [rotary]  # a list, so the shared module is neither re-registered nor in the state dict

    def forward(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D] and kv [N, 2, Hkv, D] (views of the merged projection) -> [N, Hq * D]."""
        ctx = get_global_ctx()
        self.rotary[0].forward_(ctx.batch.positions, q, kv[:, 0])
        return ctx.attn_backend.forward(q, kv, self.layer_id, ctx.batch)
