"""Rotary position embedding with HF's angles: inverse frequencies and angles in fp32, rotate-half (neox) layout. The
module holds the cos | sin table; the rotation is the ops' (rope_, inside qk_rope_store_)."""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.layers.ops import TorchOps
from engine.models.config import RotaryConfig


def _inv_freq(cfg: RotaryConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if cfg.scaling is None:
        return inv_freq
    s = cfg.scaling
    if s["rope_type"] == "linear":  # positions divided by `factor`
        return inv_freq / s["factor"]
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s["factor"], inv_freq)
    smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
        s["high_freq_factor"] - s["low_freq_factor"])
    blended = (1 - smooth) * scaled / s["factor"] + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def cos_sin_table(cfg: RotaryConfig, max_position: int) -> torch.Tensor:
    """[max_position, head_dim] fp32 on the CPU: cos | sin of each position's D / 2 angles. Computed on the CPU
    explicitly: the model itself is built under torch.device("meta")."""
    t = torch.arange(max_position, dtype=torch.float32, device="cpu")
    freqs = torch.outer(t, _inv_freq(cfg))  # one fp32 product per entry, bitwise what HF's matmul gives
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: RotaryConfig, max_position: int, dtype: torch.dtype, device: torch.device,
                 ops: TorchOps) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.register_buffer("table", ops.rope_table(cos_sin_table(cfg, max_position), dtype).to(device),
                             persistent=False)
