"""The fused MoE path (CUDA, bf16): route, sort the (token, k) pairs by expert, two grouped GEMMs (torch._grouped_mm:
CUTLASS on sm90 / sm100, no host synchronization, so decode is captured in CUDA graphs), and the weighted sum over
k as one batched matmul.

Numerics beside the reference: the GEMMs are the kernel transformers' own grouped_mm uses on the GPU; the gated
activation is FlashInfer's fused kernel (one rounding) when it is installed; the weighted sum accumulates the k
products in fp32 and rounds once (HF rounds each product to bf16 first).
"""

from __future__ import annotations

from typing import Dict

import torch

from engine.moe.base import MoEBackend
from engine.moe.torch_backend import torch_act
from engine.utils.device import has_flashinfer


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """a [S, K] sorted by group, b [G, K, M], offsets [G] int32 (end row of each group) -> [S, M]."""
    return torch._grouped_mm(a, b, offs=offsets)


class FusedMoE(MoEBackend):
    def __init__(self, device: torch.device) -> None:
        self.fused_act = None
        if device.type == "cuda" and has_flashinfer():
            import flashinfer

            self.fused_act = {"silu": flashinfer.silu_and_mul, "gelu_tanh": flashinfer.gelu_tanh_and_mul}
        self._experts: Dict[tuple, torch.Tensor] = {}  # (E, device) -> arange(E), built once (graph capture)

    def _expert_ids(self, num_experts: int, device: torch.device) -> torch.Tensor:
        key = (num_experts, device)
        if key not in self._experts:
            self._experts[key] = torch.arange(num_experts, device=device)
        return self._experts[key]

    def _act_and_mul(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        if self.fused_act is not None:
            return self.fused_act[act](gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return torch_act(gate, act) * up

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                top_k: int, renormalize: bool, weights_fp32: bool, act: str) -> torch.Tensor:
        n, hidden = x.shape
        weights, ids = self.select_experts(router_logits, top_k, renormalize, weights_fp32)
        sorted_ids, order = ids.flatten().sort(stable=True)  # [N K]: pairs grouped by expert
        # end of each expert's group: pairs with an id <= e (an expert nobody chose has an empty group)
        offsets = torch.searchsorted(sorted_ids, self._expert_ids(gate_up.shape[0], x.device), right=True).int()
        h = grouped_mm(x[order // top_k], gate_up.transpose(1, 2), offsets)  # [N K, 2I]
        y = grouped_mm(self._act_and_mul(h, act), down.transpose(1, 2), offsets)  # [N K, H]
        per_pair = y[order.argsort()].view(n, top_k, hidden)  # back in (token, k) order
        if weights_fp32:
            return torch.bmm(weights.unsqueeze(1), per_pair.float()).squeeze(1).to(x.dtype)
        return torch.bmm(weights.unsqueeze(1), per_pair).squeeze(1)
