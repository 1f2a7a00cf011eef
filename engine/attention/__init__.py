"""Attention backends: "torch" (reference, any device) and "flashinfer" (CUDA)."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, BaseAttnMetadata
from engine.models.config import ModelConfig
from engine.utils.device import has_flashinfer

BACKENDS = ("torch", "flashinfer")


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """"auto" -> flashinfer on CUDA for half precision when it is installed, torch otherwise."""
    if name == "auto":
        half = dtype in (torch.float16, torch.bfloat16)
        return "flashinfer" if device.type == "cuda" and half and has_flashinfer() else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of: auto, {', '.join(BACKENDS)}")
    if name == "flashinfer" and device.type != "cuda":
        raise ValueError("the flashinfer attention backend needs a CUDA device")
    if name == "flashinfer" and dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"FlashInfer has no {dtype} attention kernels: use attention_backend='torch'")
    return name


def create_attention_backend(name: str, model_config: ModelConfig, num_qo_heads: int, num_kv_heads: int,
                             device: torch.device, dtype: torch.dtype, invariant: bool = False) -> AttentionBackend:
    if name == "flashinfer":
        from engine.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(model_config, num_qo_heads, num_kv_heads, device, dtype)
    from engine.attention.torch_backend import TorchBackend

    return TorchBackend(model_config, per_request=invariant)


__all__ = ["AttentionBackend", "BaseAttnMetadata", "create_attention_backend", "resolve_attention_backend"]
