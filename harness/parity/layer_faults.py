"""Faults planted in one layer of the engine (HF stays the reference), to show that --explain names that layer and
the half it is in: `with planted_in_layer(name, k):`. Like harness.resolution.faults, each patches a class of the
engine while entered (harness.resolution.faults.patched): DecoderLayer.forward, so it reaches every engine built or
run inside, and changes layer k only while layer k runs.

- attention-scaled: what layer k's attention adds to the residual stream x ATTENTION_SCALE.
- rope-base: layer k rotates q and k with the RoPE base x ROPE_BASE_FACTOR.
- mlp-norm-unweighted: layer k's norm before the MLP (HF's post_attention_layernorm, or pre_feedforward_layernorm)
  applies no weight (a weight of ones).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Callable, ContextManager, Dict, Iterator

import torch

from engine.layers.rotary import cos_sin_table
from engine.models.decoder import DecoderLayer
from harness.parity.rerun import recorded
from harness.resolution.faults import Patch, patched

ATTENTION_SCALE = 1.25
ROPE_BASE_FACTOR = 0.01


def _in_layer(k: int, fault: Callable[[DecoderLayer], ContextManager[None]]) -> Patch:
    """DecoderLayer.forward with `fault(layer)` entered while layer k runs."""
    def wrap(original: Callable) -> Callable:
        def forward(self: DecoderLayer, x: torch.Tensor, residual: torch.Tensor | None) -> tuple:
            if self.self_attn.attn.layer_id != k:
                return original(self, x, residual)
            with fault(self):
                return original(self, x, residual)
        return forward
    return (DecoderLayer, "forward", wrap)


@contextmanager
def _attention_scaled(layer: DecoderLayer) -> Iterator[None]:
    """What the attention adds to the stream x ATTENTION_SCALE: its output, or a sandwich-norm model's normed output
    (the norm would undo a scale before it)."""
    module = layer.post_attention_layernorm or layer.self_attn
    forward = module.forward
    module.forward = lambda *args: forward(*args) * ATTENTION_SCALE  # an instance attribute, ahead of the class's
    try:
        yield
    finally:
        del module.forward


_wrong_tables: Dict[tuple, Any] = {}  # by everything a table's values follow from


@contextmanager
def _rope_base(layer: DecoderLayer) -> Iterator[None]:
    attn = layer.self_attn.attn
    rotary = attn.rotary
    rot = rotary[0]
    key = (repr(rot.cfg), tuple(rot.table.shape), rot.table.dtype, str(rot.table.device))
    if key not in _wrong_tables:
        table = cos_sin_table(replace(rot.cfg, base=rot.cfg.base * ROPE_BASE_FACTOR), rot.table.shape[0])
        _wrong_tables[key] = SimpleNamespace(table=rot.ops.rope_table(table, rot.table.dtype).to(rot.table.device))
    attn.rotary = [_wrong_tables[key]]
    try:
        yield
    finally:
        attn.rotary = rotary


@contextmanager
def _mlp_norm_unweighted(layer: DecoderLayer) -> Iterator[None]:
    norm = layer.pre_feedforward_layernorm
    weight = norm.weight.data
    norm.weight.data = torch.full_like(weight, 1.0 - norm.offset)  # the weight applied is offset + w
    try:
        yield
    finally:
        norm.weight.data = weight


# name -> (the patch for layer k, the half of the layer it is in)
FAULTS: Dict[str, tuple[Callable[[DecoderLayer], ContextManager[None]], str]] = {
    "attention-scaled": (_attention_scaled, "attention"),
    "rope-base": (_rope_base, "attention"),
    "mlp-norm-unweighted": (_mlp_norm_unweighted, "mlp"),
}


@contextmanager
def planted_in_layer(name: str, layer: int) -> Iterator[None]:
    if name not in FAULTS:
        raise ValueError(f"unknown layer fault {name!r}; choose one of: {', '.join(FAULTS)}")
    with recorded(planted_in_layer, name, layer), patched([_in_layer(layer, FAULTS[name][0])]):
        yield
