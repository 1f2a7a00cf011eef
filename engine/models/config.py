"""ModelConfig.from_hf: the only place Hugging Face attribute names appear."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict


@dataclass(frozen=True)
class RotaryConfig:
    head_dim: int
    max_position: int
    base: float
    scaling: Dict[str, Any] | None  # HF rope_parameters beyond theta, e.g. {"rope_type": "llama3", ...}


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
    rotary_config: RotaryConfig
    tie_word_embeddings: bool
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    attention_bias: bool  # bias on the q/k/v projections
    hidden_act: str
    is_moe: bool = False

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        arch = (getattr(hf, "architectures", None) or ["<none>"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
        if hf.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hf.hidden_act!r}; supported: silu")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        rope = dict(getattr(hf, "rope_parameters", None) or {})  # transformers >= 5
        theta = rope.pop("rope_theta", None) or getattr(hf, "rope_theta", 10000.0)
        legacy_scaling = getattr(hf, "rope_scaling", None)  # transformers 4.x
        if legacy_scaling and not rope:
            rope = dict(legacy_scaling)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, llama3")
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_qo_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rotary_config=RotaryConfig(
                head_dim=head_dim,
                max_position=hf.max_position_embeddings,
                base=float(theta),
                scaling=dict(rope, rope_type=rope_type) if rope_type != "default" else None,
            ),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)) or ARCHITECTURES[arch]["attention_bias"],
            qk_norm=ARCHITECTURES[arch]["qk_norm"],
            hidden_act=hf.hidden_act,
        )


# What each architecture adds to the shared decoder; everything else is read from its config.
ARCHITECTURES: Dict[str, Dict[str, bool]] = {
    "LlamaForCausalLM": {"qk_norm": False, "attention_bias": False},
    "Qwen2ForCausalLM": {"qk_norm": False, "attention_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True, "attention_bias": False},
}
