"""The attention layer: RoPE on q and k, then the backend, which stores k and v in the pool and attends."""

from __future__ import annotations

import torch
from torch import nn

from engine.core import get_global_ctx
from engine.layers.rotary import RotaryEmbedding


class AttentionLayer(nn.Module):
    def __init__(self, layer_id: int, head_dim: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = head_dim
        self.rotary = [rotary]  # a list, so the shared module is neither re-registered nor in the state dict

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D], k and v [N, Hkv, D] -> [N, Hq * D]."""
        ctx = get_global_ctx()
        q, k = self.rotary[0](ctx.batch.positions, q, k)
        return ctx.attn_backend.forward(q, k, v, self.layer_id, ctx.batch)
