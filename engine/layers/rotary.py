"""Rotary position embedding with HF's numerics: angles in fp32, cos/sin cast to the model dtype, rotate-half."""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.models.config import RotaryConfig


def _inv_freq(cfg: RotaryConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if cfg.scaling is None:
        return inv_freq
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
    s = cfg.scaling
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s["factor"], inv_freq)
    smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
        s["high_freq_factor"] - s["low_freq_factor"])
    blended = (1 - smooth) * scaled / s["factor"] + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: RotaryConfig, max_position: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        # Computed on the CPU explicitly: the model itself is built under torch.device("meta").
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, _inv_freq(cfg))  # one fp32 product per entry, bitwise what HF's matmul gives
        emb = torch.cat([freqs, freqs], dim=-1)
        # [max_position, head_dim] each, in the model dtype as HF casts them
        self.register_buffer("cos", emb.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype=dtype, device=device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N]; q [N, Hq, D]; k [N, Hkv, D]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)
