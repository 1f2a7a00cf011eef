"""ModelConfig.from_hf: the only place Hugging Face attribute names appear."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, FrozenSet, Literal, Tuple

LayerType = Literal["full", "sliding"]


@dataclass(frozen=True)
class RotaryConfig:
    head_dim: int
    max_position: int
    base: float
    scaling: Dict[str, Any] | None  # HF rope parameters beyond theta, e.g. {"rope_type": "llama3", ...}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rotary_config: RotaryConfig  # full-attention layers
    tie_word_embeddings: bool
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)
    attention_bias: bool  # bias on the q/k/v projections
    hidden_act: Literal["silu", "gelu_tanh"]  # the gate's activation in the MLP
    layer_types: Tuple[LayerType, ...]  # per layer: full causal attention, or a sliding window
    sliding_window: int | None = None  # a sliding layer's query sees its own key and the window - 1 before it
    local_rotary_config: RotaryConfig | None = None  # sliding layers' RoPE when it differs (Gemma 3: base 1e4)
    attn_scale: float | None = None  # softmax scale; None = head_dim ** -0.5
    embed_scale: float | None = None  # embeddings multiplied by this in the model dtype (Gemma: sqrt(hidden))
    norm_offset: float = 0.0  # RMSNorm applies offset + w (Gemma stores w - 1: offset 1)
    sandwich_norm: bool = False  # a norm after attention and after the MLP too, before the residual add (Gemma)
    o_bias: bool = False  # bias on the attention's output projection (HF's attention_bias but Qwen2's, always off)
    mlp_bias: bool = False  # bias on the MLP's gate, up and down projections (Llama's mlp_bias)
    # mixture of experts: a router (softmax over num_experts, top num_experts_per_tok) and SwiGLU experts of
    # moe_intermediate_size on the layers moe_layers marks; the others keep the dense MLP of intermediate_size
    is_moe: bool = False
    moe_layers: Tuple[bool, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top-k router probabilities renormalized to sum to 1
    router_weights_fp32: bool = False  # the expert outputs weighted in fp32 (Mixtral), not in the model dtype

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        arch = (getattr(hf, "architectures", None) or ["<none>"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
        flags = ARCHITECTURES[arch]
        act = getattr(hf, "hidden_activation", None) or hf.hidden_act
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}; supported: {', '.join(_ACTIVATIONS)}")
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(hf, cap, None) is not None:
                raise ValueError(f"unsupported {cap}={getattr(hf, cap)} (logit soft-capping is not implemented)")
        if getattr(hf, "use_bidirectional_attention", False):
            raise ValueError("unsupported use_bidirectional_attention=True: the engine's attention is causal")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        num_layers = hf.num_hidden_layers
        layer_types = tuple(_LAYER_TYPES[t] for t in (getattr(hf, "layer_types", None) or
                                                      ["full_attention"] * num_layers))
        sliding = "sliding" in layer_types
        global_rope, local_rope = _rope_parameters(hf)
        scalar = getattr(hf, "query_pre_attn_scalar", None)
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=num_layers,
            num_qo_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rotary_config=_rotary(global_rope, head_dim, hf.max_position_embeddings),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)) or flags["attention_bias"],
            qk_norm=flags["qk_norm"],
            hidden_act=_ACTIVATIONS[act],
            layer_types=layer_types,
            sliding_window=hf.sliding_window if sliding else None,
            local_rotary_config=_rotary(local_rope, head_dim, hf.max_position_embeddings) if local_rope else None,
            attn_scale=float(scalar) ** -0.5 if scalar is not None else None,
            embed_scale=float(hf.hidden_size) ** 0.5 if flags["scaled_embedding"] else None,
            norm_offset=1.0 if flags["norm_offset"] else 0.0,
            sandwich_norm=flags["sandwich_norm"],
            o_bias=bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            **(_moe_fields(hf, arch, num_layers) if flags["moe"] else {}),
        )


# config.json fields a MoE model must state (alternative spellings in a tuple): transformers fills a missing one with a
# default (128 experts, top 8) that would silently describe another model
MOE_REQUIRED: Dict[str, Tuple[Tuple[str, ...], ...]] = {
    "Qwen3MoeForCausalLM": (("num_experts", "num_local_experts"), ("num_experts_per_tok",),
                            ("moe_intermediate_size",), ("norm_topk_prob",)),
    "MixtralForCausalLM": (("num_local_experts", "num_experts"), ("num_experts_per_tok",), ("intermediate_size",)),
}


def _file_keys(hf: Any) -> FrozenSet[str] | None:
    """The keys config.json itself holds (None for a config not read from a folder)."""
    path = Path(getattr(hf, "_name_or_path", "") or "") / "config.json"
    return frozenset(json.loads(path.read_text())) if path.is_file() else None


def _moe_fields(hf: Any, arch: str, num_layers: int) -> Dict[str, Any]:
    keys = _file_keys(hf)
    if keys is not None:
        for names in MOE_REQUIRED[arch]:
            if not keys & set(names):
                raise ValueError(f"{arch} config.json lacks {' / '.join(names)}: a mixture-of-experts model must state "
                                 "it (transformers would fill in a default that describes another model)")
    num_experts, top_k = hf.num_experts if hasattr(hf, "num_experts") else hf.num_local_experts, hf.num_experts_per_tok
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must lie in [1, num_experts {num_experts}]")
    if arch == "MixtralForCausalLM":  # every layer sparse, experts of intermediate_size, top-k always renormalized
        if getattr(hf, "sliding_window", None) is not None:
            raise ValueError(f"unsupported Mixtral sliding_window={hf.sliding_window} (set it to null)")
        return dict(is_moe=True, moe_layers=(True,) * num_layers, num_experts=num_experts, num_experts_per_tok=top_k,
                    moe_intermediate_size=hf.intermediate_size, norm_topk_prob=True, router_weights_fp32=True)
    dense = set(getattr(hf, "mlp_only_layers", None) or [])
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return dict(is_moe=True, moe_layers=layers, num_experts=num_experts, num_experts_per_tok=top_k,
                moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob))


def _rope_parameters(hf: Any) -> tuple[Dict[str, Any], Dict[str, Any] | None]:
    """(global, local) RoPE parameters; local is None when every layer uses the global ones."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})  # transformers >= 5
    if "full_attention" in rope:  # per layer type (Gemma 3)
        return dict(rope["full_attention"]), dict(rope["sliding_attention"])
    theta = rope.pop("rope_theta", None) or getattr(hf, "rope_theta", 10000.0)
    legacy_scaling = getattr(hf, "rope_scaling", None)  # transformers 4.x
    if legacy_scaling and not rope:
        rope = dict(legacy_scaling)
    return dict(rope, rope_theta=theta), None


def _rotary(params: Dict[str, Any], head_dim: int, max_position: int) -> RotaryConfig:
    params = dict(params)
    theta = params.pop("rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3")
    return RotaryConfig(head_dim=head_dim, max_position=max_position, base=float(theta),
                        scaling=dict(params, rope_type=rope_type) if rope_type != "default" else None)


_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_LAYER_TYPES: Dict[str, LayerType] = {"full_attention": "full", "sliding_attention": "sliding"}

# What each architecture adds to the shared decoder; everything else is read from its config.
_DENSE = {"qk_norm": False, "attention_bias": False, "sandwich_norm": False, "norm_offset": False,
          "scaled_embedding": False, "moe": False}
ARCHITECTURES: Dict[str, Dict[str, bool]] = {
    "LlamaForCausalLM": _DENSE,
    "Qwen2ForCausalLM": dict(_DENSE, attention_bias=True),
    "Qwen3ForCausalLM": dict(_DENSE, qk_norm=True),
    "Gemma3ForCausalLM": dict(_DENSE, qk_norm=True, sandwich_norm=True, norm_offset=True, scaled_embedding=True),
    "Qwen3MoeForCausalLM": dict(_DENSE, qk_norm=True, moe=True),
    "MixtralForCausalLM": dict(_DENSE, moe=True),
}
