"""The MoE backend interface and the routing every backend shares (Hugging Face's numerics).

A backend maps a layer's input and its router logits to the experts' weighted sum, on this rank's shard of every
expert (the intermediate dimension is split across TP ranks; the layer all-reduces the partial sums once).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class MoEBackend(ABC):
    def select_experts(self, router_logits: torch.Tensor, top_k: int, renormalize: bool,
                       weights_fp32: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [N, E] in the model dtype -> (weights [N, K], expert ids [N, K] int64), HF's router: softmax
        in fp32, the top k probabilities (optionally renormalized in fp32), cast back to the model dtype unless
        weights_fp32 (Mixtral keeps them in fp32)."""
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if weights_fp32 else weights.to(router_logits.dtype)), ids

    @abstractmethod
    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                top_k: int, renormalize: bool, weights_fp32: bool, act: str) -> torch.Tensor:
        """x [N, H], router_logits [N, E], gate_up [E, 2I, H] (gate | up rows), down [E, H, I] -> [N, H]: for each
        token, the sum over its top_k experts of weight x down(act(gate x) * up x), in x's dtype."""


def router_margin(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """[N, E] -> [N] float32: the gap between the k-th and (k+1)-th router logits relative to the row's largest
    |logit| (the softmax keeps the order of the logits, so this gap decides the k-th expert). inf when every
    expert is chosen."""
    logits = router_logits.float()
    if top_k >= logits.shape[-1]:
        return torch.full(logits.shape[:1], float("inf"), device=logits.device)
    top = logits.topk(top_k + 1, dim=-1).values
    scale = logits.abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    return (top[:, top_k - 1] - top[:, top_k]) / scale
