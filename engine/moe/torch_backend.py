"""The readable MoE reference (any device and dtype), with transformers' numerics (Qwen3MoeExperts, its default
grouped_mm implementation, 5.17 and 5.24 alike): each expert's tokens through F.linear, act(gate) * up in the model
dtype, the down projection, each (token, k) output times its weight (rounded to the model dtype, or in fp32 when
the weights are), then summed over k.

It loops over the experts that were chosen, which reads the routing on the host: a CUDA engine with this backend
runs decode without CUDA graphs. An expert's GEMMs have as many rows as the batch sent it: in batch-invariant mode
they and the activation are engine/batch_invariant.py's, whose rows do not depend on that count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import batch_invariant
from engine.moe.base import MoEBackend


def torch_act(gate: torch.Tensor, act: str) -> torch.Tensor:
    return F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")


def torch_act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch_act(gate, act) * up


class TorchMoE(MoEBackend):
    def __init__(self, invariant: bool = False) -> None:
        self.linear = batch_invariant.linear if invariant else F.linear
        self.act_and_mul = batch_invariant.act_and_mul if invariant else torch_act_and_mul

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                top_k: int, renormalize: bool, weights_fp32: bool, act: str) -> torch.Tensor:
        n, hidden = x.shape
        weights, ids = self.select_experts(router_logits, top_k, renormalize, weights_fp32)
        flat = ids.flatten()  # [N K]: row t * K + k is token t's k-th choice
        out = x.new_zeros(n * top_k, hidden)
        for e in flat.unique().tolist():
            rows = (flat == e).nonzero().squeeze(1)
            out[rows] = self.linear(self.act_and_mul(self.linear(x[rows // top_k], gate_up[e]), act), down[e])
        return (out * weights.reshape(-1, 1)).view(n, top_k, hidden).sum(dim=1).to(x.dtype)
