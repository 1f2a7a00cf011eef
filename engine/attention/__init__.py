"""Attention backends: "torch" (reference, any device), "flashinfer" (CUDA, half precision) and "cpu" (the paged fp32
kernel of kernels/cpu_kernels.py)."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, BaseAttnMetadata
from engine.kernels import cpu_kernels
from engine.models.config import ModelConfig
from engine.utils.device import has_flashinfer

BACKENDS = ("torch", "flashinfer", "cpu")


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype, model: ModelConfig) -> str:
    """"auto" -> flashinfer on CUDA for half precision when it is installed, cpu on a CPU in fp32 where its kernel
    builds and serves the model's heads, torch otherwise."""
    group = model.num_qo_heads // model.num_kv_heads
    # asked only where the cpu backend could be chosen: available() builds the library on a machine's first call
    cpu = name in ("auto", "cpu") and device.type == "cpu" and dtype == torch.float32 \
        and cpu_kernels.available(model.head_dim, group)
    if name == "auto":
        half = dtype in (torch.float16, torch.bfloat16)
        if device.type == "cuda" and half and has_flashinfer():
            return "flashinfer"
        return "cpu" if cpu else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of: auto, {', '.join(BACKENDS)}")
    if name == "flashinfer" and device.type != "cuda":
        raise ValueError("the flashinfer attention backend needs a CUDA device")
    if name == "flashinfer" and dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"FlashInfer has no {dtype} attention kernels: use attention_backend='torch'")
    if name == "cpu" and not cpu:
        raise ValueError(f"the cpu attention backend needs a CPU, fp32, a C++ compiler, head_dim in "
                         f"{cpu_kernels.HEAD_DIMS} and at most {cpu_kernels.MAX_GROUP} query heads a KV head, got "
                         f"{device.type} {dtype}, head_dim {model.head_dim}, {group}: use attention_backend='torch'")
    return name


def create_attention_backend(name: str, model_config: ModelConfig, num_qo_heads: int, num_kv_heads: int,
                             device: torch.device, dtype: torch.dtype, invariant: bool = False) -> AttentionBackend:
    if name == "flashinfer":
        from engine.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(model_config, num_qo_heads, num_kv_heads, device, dtype)
    if name == "cpu":
        from engine.attention.cpu_backend import CpuBackend

        return CpuBackend(model_config)
    from engine.attention.torch_backend import TorchBackend

    return TorchBackend(model_config, per_request=invariant)


__all__ = ["AttentionBackend", "BaseAttnMetadata", "create_attention_backend", "resolve_attention_backend"]
