"""The sparse MoE block: a replicated router and this rank's shard of every expert, computed by the engine's MoE
backend (the global context's, chosen once), the partial sums meeting in one all-reduce like the dense MLP's."""

from __future__ import annotations

import torch
from torch import nn

from engine.core import get_global_ctx
from engine.distributed import div_even, get_tp_info, tp_all_reduce
from engine.layers.ops import TorchOps
from engine.models.config import ModelConfig
from engine.moe.base import router_margin


class Experts(nn.Module):
    """Every expert's weights stacked for the grouped GEMMs (HF's per-expert tensors are stacked at load)."""

    def __init__(self, num_experts: int, hidden: int, inter_per_rank: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter_per_rank, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter_per_rank), requires_grad=False)


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, moe_index: int, ops: TorchOps) -> None:
        super().__init__()
        self.ops = ops
        inter = div_even(config.moe_intermediate_size, get_tp_info().size)
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # the router, replicated
        self.gate.weight.requires_grad_(False)
        self.experts = Experts(config.num_experts, config.hidden_size, inter)
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        self.weights_fp32, self.act = config.router_weights_fp32, config.hidden_act
        self.moe_index = moe_index  # this block's column of the context's router-margin record

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> [N, H]."""
        ctx = get_global_ctx()
        router_logits = self.ops.router(x, self.gate.weight)  # [N, E] in the model dtype, as HF computes them
        if ctx.router_margins is not None:  # parity's router near-tie detection asked for them
            ctx.router_margins[: x.shape[0], self.moe_index] = router_margin(router_logits, self.top_k)
        out = ctx.moe_backend.forward(x, router_logits, self.experts.gate_up_proj, self.experts.down_proj,
                                      self.top_k, self.renormalize, self.weights_fp32, self.act)
        return tp_all_reduce(out)
