"""The exact results the component checks measure against: float64 math from the definitions, on the bf16-rounded
inputs both implementations receive. Written from the definitions, not by calling the engine's reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cached_len: int, window: int | None,
              scale: float) -> torch.Tensor:
    """One request: q [ext, Hq, D] at positions cached_len.., keys and values [kv_len, Hkv, D] of positions 0..
    -> [ext, Hq * D]. Key j is visible to the query at position i when j <= i and, with a window, i - j < window;
    q head h reads KV head h // (Hq / Hkv)."""
    ext, hq, d = q.shape
    group = hq // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)  # [L, Hq, D]
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    qpos = torch.arange(cached_len, cached_len + ext, device=q.device)[:, None]
    kpos = torch.arange(keys.shape[0], device=q.device)[None, :]
    visible = kpos <= qpos
    if window is not None:
        visible &= qpos - kpos < window
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(ext, hq * d)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * (offset + weight) over the last dimension."""
    h = x.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.double())


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual), the sum exact."""
    total = x.double() + residual.double()
    return rmsnorm(total, weight, eps, offset), total


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [N, H, D], cos and sin [N, D / 2] (the table's values at each token's position)."""
    x1, x2 = x.double().chunk(2, dim=-1)
    c, s = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """[N, 2I] (gate | up) -> act(gate) * up, act silu or gelu with the tanh approximation."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up
