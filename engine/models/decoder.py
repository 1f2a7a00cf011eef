"""One decoder for every supported architecture: embed -> N x [norm, attention, norm, MLP] -> norm -> head.

Architectures differ only by ModelConfig fields (qk_norm, attention_bias, tie_word_embeddings, rope).
Parameter names follow HF's, with q/k/v merged into qkv_proj and gate/up into gate_up_proj (models/weights.py).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.core import get_global_ctx
from engine.distributed import div_even, get_tp_info
from engine.layers.activation import silu_and_mul
from engine.layers.attention import AttentionLayer
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding, compute_logits
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.config import ModelConfig


def heads_per_rank(config: ModelConfig) -> tuple[int, int]:
    """(q heads, kv heads) on this rank; KV heads are replicated when there are fewer than ranks."""
    tp = get_tp_info().size
    return div_even(config.num_qo_heads, tp), div_even(config.num_kv_heads, tp, allow_replicate=True)


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_qo_heads, self.num_kv_heads = heads_per_rank(config)
        self.head_dim = d = config.head_dim
        qkv_out = (self.num_qo_heads + 2 * self.num_kv_heads) * d
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, qkv_out, bias=config.attention_bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.attn = AttentionLayer(layer_id, d, rotary)
        self.o_proj = RowParallelLinear(self.num_qo_heads * d, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d, hq, hkv = self.head_dim, self.num_qo_heads, self.num_kv_heads
        q, k, v = self.qkv_proj(x).split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.reshape(-1, hq, d), k.reshape(-1, hkv, d), v.reshape(-1, hkv, d)
        if self.q_norm is not None:  # Qwen3: per-head RMSNorm before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(self.attn(q, k, v))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inter = div_even(config.intermediate_size, get_tp_info().size)
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, 2 * inter, bias=False)
        self.down_proj = RowParallelLinear(inter, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer_id, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm.forward_residual(x, residual)
        x = self.self_attn(x)
        x, residual = self.post_attention_layernorm.forward_residual(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, rotary) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual)
        return self.norm.forward_residual(x, residual)[0]


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_position: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config.rotary_config, max_position, dtype, device)
        self.model = DecoderModel(config, self.rotary)
        self.lm_head = None if config.tie_word_embeddings else ParallelLMHead(config.vocab_size, config.hidden_size)

    def forward(self) -> torch.Tensor:
        """Logits [rows, vocab] for the batch in the global context: one row per request (its last token),
        or one per token when the batch asks for all positions."""
        batch = get_global_ctx().batch
        hidden = self.model(batch.input_ids)
        if batch.return_logits != "all" and batch.is_prefill:
            hidden = hidden[batch.attn_metadata.last_indices()]
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return compute_logits(hidden, weight, self.config.vocab_size)


def create_model(config: ModelConfig, max_position: int, device: torch.device, dtype: torch.dtype) -> CausalLM:
    return CausalLM(config, max_position, device, dtype)
