"""Faults planted in one layer of the engine (HF stays the reference), to show that --explain names that layer and
the half it is in: `with planted_in_layer(name, k):`. Like harness.resolution.faults, each patches a class of the
engine while entered (harness.resolution.faults.patched), so it reaches every engine built or run inside, and acts
only on layer k.

- attention-scaled: layer k's attention output (after o_proj) x ATTENTION_SCALE.
- rope-base: layer k rotates q and k with the RoPE base x ROPE_BASE_FACTOR.
- mlp-norm-unweighted: layer k's norm before the MLP (HF's post_attention_layernorm, or pre_feedforward_layernorm)
  applies no weight (a weight of ones).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterator

import torch

from engine.layers.attention import AttentionLayer
from engine.layers.rotary import cos_sin_table
from engine.models.decoder import DecoderLayer, SelfAttention
from harness.resolution.faults import Patch, patched

ATTENTION_SCALE = 1.25
ROPE_BASE_FACTOR = 0.01


def _attention_scaled(k: int) -> Patch:
    def wrap(original: Callable) -> Callable:
        def forward(self: SelfAttention, x: torch.Tensor) -> torch.Tensor:
            out = original(self, x)
            return out * ATTENTION_SCALE if self.attn.layer_id == k else out
        return forward
    return (SelfAttention, "forward", wrap)


def _rope_base(k: int) -> Patch:
    tables: Dict[int, Any] = {}

    def wrap(original: Callable) -> Callable:
        def forward(self: AttentionLayer, q: torch.Tensor, kv: torch.Tensor, norms: tuple | None) -> torch.Tensor:
            if self.layer_id != k:
                return original(self, q, kv, norms)
            rotary = self.rotary
            rot = rotary[0]
            if id(rot) not in tables:
                table = cos_sin_table(replace(rot.cfg, base=rot.cfg.base * ROPE_BASE_FACTOR), rot.table.shape[0])
                tables[id(rot)] = SimpleNamespace(table=rot.ops.rope_table(table, q.dtype).to(rot.table.device))
            self.rotary = [tables[id(rot)]]
            try:
                return original(self, q, kv, norms)
            finally:
                self.rotary = rotary
        return forward
    return (AttentionLayer, "forward", wrap)


def _mlp_norm_unweighted(k: int) -> Patch:
    def wrap(original: Callable) -> Callable:
        def forward(self: DecoderLayer, x: torch.Tensor, residual: torch.Tensor | None) -> tuple:
            if self.self_attn.attn.layer_id != k:
                return original(self, x, residual)
            norm = self.pre_feedforward_layernorm
            weight = norm.weight.data
            norm.weight.data = torch.full_like(weight, 1.0 - norm.offset)  # the weight applied is offset + w
            try:
                return original(self, x, residual)
            finally:
                norm.weight.data = weight
        return forward
    return (DecoderLayer, "forward", wrap)


# name -> (the patch for layer k, the half of the layer it is in)
FAULTS: Dict[str, tuple[Callable[[int], Patch], str]] = {
    "attention-scaled": (_attention_scaled, "attention"),
    "rope-base": (_rope_base, "attention"),
    "mlp-norm-unweighted": (_mlp_norm_unweighted, "mlp"),
}


@contextmanager
def planted_in_layer(name: str, layer: int) -> Iterator[None]:
    if name not in FAULTS:
        raise ValueError(f"unknown layer fault {name!r}; choose one of: {', '.join(FAULTS)}")
    with patched([FAULTS[name][0](layer)]):
        yield
