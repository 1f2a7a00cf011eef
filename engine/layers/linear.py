"""Tensor-parallel linear layers. Weights arrive already sharded (models/weights.py), so these only compute; the
product itself is the engine's ops object's (TorchOps.linear: F.linear; the fused ops take few-row calls to the
skinny GEMM)."""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed import get_tp_info, tp_all_reduce
from engine.layers.ops import TorchOps


class ColumnParallelLinear(nn.Module):
    """Output features split across ranks; merged projections (qkv, gate_up) are one matmul."""

    def __init__(self, in_features: int, out_features_per_rank: int, bias: bool, ops: TorchOps) -> None:
        super().__init__()
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(out_features_per_rank, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features_per_rank), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features split across ranks; the partial sums meet in one all-reduce."""

    def __init__(self, in_features_per_rank: int, out_features: int, ops: TorchOps, bias: bool = False) -> None:
        super().__init__()
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(out_features, in_features_per_rank), requires_grad=False)
        # replicated: added once, after the partial sums meet (inside the GEMM on one rank, as HF's nn.Linear adds it)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
        """act: x is gate | up and the input is act(gate) * up (ops.linear), for the MLP's down projection."""
        if self.bias is None or get_tp_info().size == 1:
            return tp_all_reduce(self.ops.linear(x, self.weight, self.bias, act=act))
        return tp_all_reduce(self.ops.linear(x, self.weight, act=act)) + self.bias
