"""RMSNorm over the hidden size, or per head (its weight and eps, applied by the attention layer's fused op); the
arithmetic is the engine's ops (layers/ops.py)."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.ops import TorchOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float, ops: TorchOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps
        self.offset = offset  # the weight applied is offset + w (Gemma stores w - 1)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rmsnorm(x, self.weight, self.eps, self.offset)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(x + residual), and x + residual as the next residual (added in the model dtype, like HF)."""
        return self.ops.add_rmsnorm(x, residual, self.weight, self.eps, self.offset)
