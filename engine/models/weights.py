"""Weight loading: HF safetensors -> this rank's shards under the decoder's names, merged where the decoder merges.

q/k/v_proj -> qkv_proj and gate/up_proj -> gate_up_proj are split by output rows; o_proj and down_proj by input
columns; embeddings and LM head by vocabulary rows (padded to a multiple of the TP size). KV heads are replicated
when there are fewer of them than ranks. A MoE layer's experts (HF: mlp.experts.<e>.{gate,up,down}_proj, Mixtral:
block_sparse_moe.experts.<e>.{w1,w3,w2}) are sharded like the dense MLP, each one alone, then stacked along a new
first dimension into mlp.experts.gate_up_proj [E, 2I, H] and mlp.experts.down_proj [E, H, I]; the router
(mlp.gate) is replicated.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Iterator, Tuple

import torch
from safetensors import safe_open

from engine.distributed import get_tp_info
from engine.models.config import ModelConfig

if TYPE_CHECKING:
    from engine.models.decoder import CausalLM

_MERGED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_ROW_PARALLEL = ("o_proj", "down_proj")
_VOCAB = ("embed_tokens", "lm_head")
_MIXTRAL = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))
_EXPERT = re.compile(r"^(?P<layer>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<kind>gate_up_proj|down_proj)\.weight$")


def _iter_safetensors(path: Path) -> Iterator[Tuple[str, torch.Tensor]]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}: prepare the model with `python -m harness models prepare`")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _shard_rows(t: torch.Tensor, index: int, count: int) -> torch.Tensor:
    rows = t.shape[0] // count
    # a copy, not a view: a view would keep the whole checkpoint tensor alive on every rank
    return t[index * rows: (index + 1) * rows].clone()


def _shard(name: str, module: str, t: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    info = get_tp_info()
    if info.size == 1:
        return t
    if module in ("k_proj", "v_proj") and config.num_kv_heads < info.size:
        # each KV head serves size / num_kv_heads consecutive ranks
        return _shard_rows(t, info.rank * config.num_kv_heads // info.size, config.num_kv_heads)
    if module in _MERGED or module in ("q_proj",):
        return _shard_rows(t, info.rank, info.size)
    if module in _ROW_PARALLEL and name.endswith("weight"):
        cols = t.shape[1] // info.size
        return t[:, info.rank * cols: (info.rank + 1) * cols].contiguous()  # a copy (the slice is strided)
    if module in _VOCAB:
        per_rank = -(-config.vocab_size // info.size)
        padded = torch.nn.functional.pad(t, (0, 0, 0, per_rank * info.size - t.shape[0]))
        return _shard_rows(padded, info.rank, info.size)
    return t  # norms: replicated


def load_weight_state_dict(path: str, config: ModelConfig, device: torch.device,
                           dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    state: Dict[str, torch.Tensor] = {}
    parts: Dict[str, Dict[int, torch.Tensor]] = {}
    for name, tensor in _iter_safetensors(Path(path)):
        if config.tie_word_embeddings and name.startswith("lm_head."):
            continue  # some checkpoints store the tied copy; the decoder reads the embedding
        if re.search(r"rotary_emb\.inv_freq$", name):
            continue
        if not config.sandwich_norm:  # Llama and Qwen call the norm before the MLP post_attention_layernorm
            name = name.replace(".post_attention_layernorm.", ".pre_feedforward_layernorm.")
        if ".block_sparse_moe." in name:
            for old, new in _MIXTRAL:
                name = name.replace(old, new)
        module = name.split(".")[-2]
        t = _shard(name, module, tensor, config).to(device=device, dtype=dtype)
        if module in _MERGED:
            merged, idx = _MERGED[module]
            key = name.replace(module, merged)
            parts.setdefault(key, {})[idx] = t
            if len(parts[key]) == (3 if merged == "qkv_proj" else 2):
                state[key] = torch.cat([parts[key][i] for i in sorted(parts[key])], dim=0)
                del parts[key]
        else:
            state[name] = t
    if parts:
        raise ValueError(f"checkpoint at {path} is missing parts of merged weights: {sorted(parts)}")
    if config.is_moe:
        stack_experts(state, config, path)
    return state


def stack_experts(state: Dict[str, torch.Tensor], config: ModelConfig, path: str) -> None:
    """Per-expert weights -> one [E, ...] tensor per MoE layer and kind, in place; a missing expert is named."""
    groups: Dict[Tuple[str, str], Dict[int, torch.Tensor]] = {}
    for name in [n for n in state if _EXPERT.match(n)]:
        m = _EXPERT.match(name)
        groups.setdefault((m["layer"], m["kind"]), {})[int(m["e"])] = state.pop(name)
    for i, sparse in enumerate(config.moe_layers):
        for kind in ("gate_up_proj", "down_proj") if sparse else ():
            layer = f"model.layers.{i}.mlp.experts"
            found = groups.pop((layer, kind), {})
            missing = [e for e in range(config.num_experts) if e not in found]
            if missing:
                hf = "gate_proj / up_proj" if kind == "gate_up_proj" else "down_proj"
                raise ValueError(f"checkpoint at {path} lacks expert {missing[0]} of layer {i} ({layer}.{missing[0]}."
                                 f"{hf}.weight; {len(missing)} of {config.num_experts} experts missing there)")
            state[f"{layer}.{kind}"] = torch.stack([found.pop(e) for e in range(config.num_experts)])
            if found:
                raise ValueError(f"checkpoint at {path} holds expert {min(found)} of layer {i}, but num_experts is "
                                 f"{config.num_experts}")
    if groups:
        sparse = [i for i, s in enumerate(config.moe_layers) if s]
        raise ValueError(f"checkpoint at {path} holds experts the config does not expect: {sorted(groups)[:3]} "
                         f"(num_experts {config.num_experts}, MoE layers {sparse})")


def dummy_state_dict(model: "CausalLM", device: torch.device, dtype: torch.dtype,
                     seed: int = 0) -> Dict[str, torch.Tensor]:
    """Random weights of the right shapes, for benchmarks on model shapes whose weights are not at hand."""
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    offset = model.config.norm_offset
    for name, p in model.state_dict().items():
        if name.endswith("norm.weight"):  # norms that multiply by 1
            state[name] = torch.full(p.shape, 1.0 - offset, device=device, dtype=dtype)
        else:
            state[name] = (torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)
    return state
