"""The hardware's limit, measured in the same run: memory bandwidth (a large copy) and the matmul rate; and the
bytes and FLOPs a forward must move, from the model's shapes."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, List

import torch

from engine import Engine


def timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> List[float]:
    """Seconds per call: CUDA events on a GPU, perf_counter after the work on a CPU; warm-up left out."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


@dataclass
class Limits:
    bandwidth: float  # bytes/s, read + write of a large device copy
    matmul_flops: float  # FLOP/s of a large square matmul in the benchmark dtype

    def floor_seconds(self, nbytes: float, flops: float) -> float:
        return max(nbytes / self.bandwidth, flops / self.matmul_flops)


def measure_limits(device: torch.device, dtype: torch.dtype) -> Limits:
    n_bytes = (2 << 30) if device.type == "cuda" else (256 << 20)  # far beyond any cache
    src = torch.empty(n_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    copy = statistics.median(timed(lambda: dst.copy_(src), device, repeats=10))
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm = statistics.median(timed(lambda: a @ b, device, repeats=10))
    return Limits(bandwidth=2 * n_bytes / copy, matmul_flops=2 * n ** 3 / mm)


@dataclass
class ModelCost:
    weight_bytes: int  # bytes every forward reads: all weights, the embedding table once (as the LM head)
    kv_bytes_per_token: int  # K and V of one token over all layers
    flops_per_token: int  # 2 x matmul parameters (the LM head included)
    attn_flops_per_pair: int  # per (query, key) pair over all layers: QK^T and PV

    def forward(self, num_tokens: int, kv_tokens: int, query_key_pairs: int) -> tuple[float, float]:
        """(bytes, FLOPs) of one forward: weights + KV read and written; matmuls + attention."""
        nbytes = self.weight_bytes + self.kv_bytes_per_token * (kv_tokens + num_tokens)
        flops = self.flops_per_token * num_tokens + self.attn_flops_per_pair * query_key_pairs
        return nbytes, flops


def model_cost(engine: Engine) -> ModelCost:
    mc = engine.config.model_config
    item = engine.dtype.itemsize
    params = sum(p.numel() for p in engine.model.parameters())
    embed = engine.model.model.embed_tokens.weight.numel()
    read = params - (0 if mc.tie_word_embeddings else embed)  # an untied embedding reads only the looked-up rows
    return ModelCost(
        weight_bytes=read * item,
        kv_bytes_per_token=2 * mc.num_layers * engine.num_kv_heads * mc.head_dim * item,
        flops_per_token=2 * read,
        attn_flops_per_pair=4 * mc.num_layers * engine.num_qo_heads * mc.head_dim,
    )
