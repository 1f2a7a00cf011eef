"""MoE backends: "torch" (the reference, any device and dtype) and "fused" (CUDA, bf16, grouped GEMMs)."""

from __future__ import annotations

import logging

import torch

from engine.models.config import ModelConfig
from engine.moe.base import MoEBackend, router_margin

logger = logging.getLogger(__name__)

MOE_BACKENDS = ("torch", "fused")


def _fused_unsupported(device: torch.device, dtype: torch.dtype, config: ModelConfig, tp: int) -> str | None:
    """Why the fused backend cannot run here, or None. torch._grouped_mm's CUTLASS kernel (bf16 on sm90 / sm100)
    needs every row of its operands 16-byte aligned; its other cases loop on the host."""
    if device.type != "cuda":
        return f"it needs a CUDA device, got {device.type}"
    if dtype != torch.bfloat16:
        return f"its grouped GEMM runs bf16 (got {dtype})"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"torch._grouped_mm's kernel needs sm90 or sm100, got sm{major}{minor}"
    if config.is_moe and (config.hidden_size % 8 or (config.moe_intermediate_size // tp) % 8):
        return (f"hidden_size {config.hidden_size} and moe_intermediate_size / TP "
                f"{config.moe_intermediate_size // tp} must be multiples of 8 (16-byte rows)")
    return None


def resolve_moe_backend(name: str, device: torch.device, dtype: torch.dtype, config: ModelConfig, tp: int) -> str:
    """"auto" -> fused on CUDA in bf16 where its kernel runs, torch otherwise."""
    if name not in ("auto",) + MOE_BACKENDS:
        raise ValueError(f"unknown MoE backend {name!r}; choose one of: auto, {', '.join(MOE_BACKENDS)}")
    why = _fused_unsupported(device, dtype, config, tp) if name != "torch" else None
    if name == "fused" and why:
        raise ValueError(f"the fused MoE backend cannot run here: {why}; use moe_backend='torch'")
    if name == "auto":
        name = "torch" if why else "fused"
        if why and config.is_moe and device.type == "cuda":
            logger.info("MoE backend: torch (the fused one cannot run: %s)", why)
    return name


def create_moe_backend(name: str, device: torch.device, invariant: bool = False) -> MoEBackend:
    if name == "fused":
        from engine.moe.fused import FusedMoE

        return FusedMoE(device)
    from engine.moe.torch_backend import TorchMoE

    return TorchMoE(invariant)


__all__ = ["MOE_BACKENDS", "MoEBackend", "create_moe_backend", "resolve_moe_backend", "router_margin"]
