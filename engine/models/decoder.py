"""One decoder for every supported architecture: embed -> N x [norm, attention, norm, MLP] -> norm -> head.

Architectures differ only by ModelConfig fields: qk_norm, attention_bias, tie_word_embeddings, RoPE (one base, or
one per layer type), per-layer sliding windows, the softmax scale, a scaled embedding, the norms' weight offset and
sandwich norms (a norm on the attention and MLP outputs before each residual add), the gate's activation, and per
layer a dense MLP or a sparse mixture of experts (layers/moe.py).
Parameter names follow HF's, with q/k/v merged into qkv_proj and gate/up into gate_up_proj, and a MoE layer's experts
stacked into experts.gate_up_proj / experts.down_proj (models/weights.py); the norm before the MLP is
pre_feedforward_layernorm in every architecture.
The small ops (norms, RoPE, activation) come from one TorchOps object chosen for the engine (layers/ops.py).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.core import Batch, get_global_ctx
from engine.distributed import div_even, get_tp_info
from engine.layers.attention import AttentionLayer
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding, compute_logits
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.layers.moe import SparseMoE
from engine.layers.norm import RMSNorm
from engine.layers.ops import TorchOps
from engine.layers.rotary import RotaryEmbedding
from engine.models.config import ModelConfig


def heads_per_rank(config: ModelConfig) -> tuple[int, int]:
    """(q heads, kv heads) on this rank; KV heads are replicated when there are fewer than ranks."""
    tp = get_tp_info().size
    return div_even(config.num_qo_heads, tp), div_even(config.num_kv_heads, tp, allow_replicate=True)


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding, ops: TorchOps) -> None:
        super().__init__()
        self.num_qo_heads, self.num_kv_heads = heads_per_rank(config)
        self.head_dim = d = config.head_dim
        qkv_out = (self.num_qo_heads + 2 * self.num_kv_heads) * d
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, qkv_out, bias=config.attention_bias, ops=ops)
        self.q_norm = RMSNorm(d, config.rms_norm_eps, config.norm_offset, ops) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps, config.norm_offset, ops) if config.qk_norm else None
        self.attn = AttentionLayer(layer_id, rotary, ops)
        self.o_proj = RowParallelLinear(self.num_qo_heads * d, config.hidden_size, ops, bias=config.o_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, d, hq, hkv = x.shape[0], self.head_dim, self.num_qo_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)  # [N, (Hq + 2 Hkv) D]: q, k and v stay views of it until the KV pool
        q = qkv[:, : hq * d].view(n, hq, d)
        kv = qkv[:, hq * d:].view(n, 2, hkv, d)
        norms = None if self.q_norm is None else (self.q_norm, self.k_norm)  # per-head RMSNorm before RoPE
        return self.o_proj(self.attn(q, kv, norms))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: TorchOps) -> None:
        super().__init__()
        inter = div_even(config.intermediate_size, get_tp_info().size)
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, 2 * inter, bias=config.mlp_bias, ops=ops)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, ops, bias=config.mlp_bias)
        self.act = config.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x), act=self.act)  # the activation inside the product's ops


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding, ops: TorchOps) -> None:
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset, ops)

        self.input_layernorm = norm()
        self.self_attn = SelfAttention(config, layer_id, rotary, ops)
        self.post_attention_layernorm = norm() if config.sandwich_norm else None
        self.pre_feedforward_layernorm = norm()
        sparse = bool(config.moe_layers) and config.moe_layers[layer_id]
        self.mlp = SparseMoE(config, sum(config.moe_layers[:layer_id]), ops) if sparse else MLP(config, ops)
        self.post_feedforward_layernorm = norm() if config.sandwich_norm else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream (None before the first layer)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm.forward_residual(x, residual)
        x = self.self_attn(x)
        if self.post_attention_layernorm is not None:
            x = self.post_attention_layernorm(x)
        x, residual = self.pre_feedforward_layernorm.forward_residual(x, residual)
        x = self.mlp(x)
        if self.post_feedforward_layernorm is not None:
            x = self.post_feedforward_layernorm(x)
        return x, residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, local_rotary: RotaryEmbedding | None,
                 dtype: torch.dtype, ops: TorchOps) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # HF multiplies by the scale rounded to the model dtype (a bf16 tensor in bf16), so round it the same way
        self.embed_scale = None if config.embed_scale is None else \
            float(torch.tensor(config.embed_scale, dtype=torch.float32, device="cpu").to(dtype))
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, local_rotary if local_rotary and config.layer_types[i] == "sliding" else rotary,
                         ops)
            for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset, ops)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        if self.embed_scale is not None:
            x = x * self.embed_scale
        for layer in self.layers:
            x, residual = layer(x, residual)
        return self.norm.forward_residual(x, residual)[0]


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_position: int, device: torch.device, dtype: torch.dtype,
                 ops: TorchOps) -> None:
        super().__init__()
        self.config, self.ops = config, ops
        self.rotary = RotaryEmbedding(config.rotary_config, max_position, dtype, device, ops)
        self.local_rotary = None if config.local_rotary_config is None else \
            RotaryEmbedding(config.local_rotary_config, max_position, dtype, device, ops)
        self.model = DecoderModel(config, self.rotary, self.local_rotary, dtype, ops)
        self.lm_head = None if config.tie_word_embeddings else ParallelLMHead(config.vocab_size, config.hidden_size)
        self.head_weight: torch.Tensor | None = None  # the LM head's weight as the ops' GEMM reads it (pack_weights)

    def pack_weights(self) -> None:
        """Every GEMM weight into the layout the ops' GEMM reads, once the weights are loaded: the projections' in
        place; a tied LM head gets a copy beside the embedding's table, which the lookup reads as it is (for the
        reference ops both are the loaded tensors, no copy)."""
        for m in self.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                m.weight = nn.Parameter(self.ops.pack(m.weight), requires_grad=False)
        if self.lm_head is None:
            self.head_weight = self.ops.pack(self.model.embed_tokens.weight)
        else:
            self.lm_head.weight = self.head_weight = nn.Parameter(self.ops.pack(self.lm_head.weight),
                                                                  requires_grad=False)

    def forward(self) -> torch.Tensor:
        """Logits [rows, vocab] for the batch in the global context."""
        batch = get_global_ctx().batch
        return self.logits(self.model(batch.input_ids), batch)

    def logits(self, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        """hidden [num_tokens, H] (the final norm's output) -> logits [rows, vocab]: one row per request (its last
        token), or one per token when the batch asks for all positions."""
        if batch.return_logits != "all" and batch.is_prefill:
            hidden = hidden[batch.attn_metadata.last_indices()]
        return compute_logits(hidden, self.head_weight, self.config.vocab_size, self.ops)


def create_model(config: ModelConfig, max_position: int, device: torch.device, dtype: torch.dtype,
                 ops: TorchOps) -> CausalLM:
    return CausalLM(config, max_position, device, dtype, ops)
