"""Tensor-parallel linear layers. Weights arrive already sharded (models/weights.py), so these only compute."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import tp_all_reduce


class ColumnParallelLinear(nn.Module):
    """Output features split across ranks; merged projections (qkv, gate_up) are one matmul."""

    def __init__(self, in_features: int, out_features_per_rank: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features_per_rank, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features_per_rank), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features split across ranks; the partial sums meet in one all-reduce."""

    def __init__(self, in_features_per_rank: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features_per_rank), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp_all_reduce(F.linear(x, self.weight))
