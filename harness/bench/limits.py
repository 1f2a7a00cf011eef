"""The hardware's limit, measured in the same run: memory bandwidth (a large copy) and the matmul rate; and the
bytes and FLOPs a forward must move, from the model's shapes."""

from __future__ import annotations

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


MATMUL_N = {"cuda": 8192, "cpu": 2048}  # square GEMMs large enough that the rate is the cores', not the caches'


def measure_limits(device: torch.device, dtype: torch.dtype) -> Limits:
    """The peak: the best of several calls (a floor divides by what the device can do, and the median of a shared
    host's calls is what its neighbours left), a GEMM large enough to be compute-bound, in this process, so at the
    thread count the bench's own forwards use (torch's)."""
    n_bytes = (2 << 30) if device.type == "cuda" else (256 << 20)  # far beyond any cache
    src = torch.empty(n_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    copy = min(timed(lambda: dst.copy_(src), device, repeats=10))
    n = MATMUL_N.get(device.type, MATMUL_N["cpu"])
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm = min(timed(lambda: a @ b, device, repeats=10 if device.type == "cuda" else 5))
    return Limits(bandwidth=2 * n_bytes / copy, matmul_flops=2 * n ** 3 / mm)


@dataclass
class ModelCost:
    weight_bytes: int  # bytes every forward reads: all weights but the experts, the embedding once (as the LM head)
    kv_bytes_per_token: int  # K and V of one token over all layers
    flops_per_token: int  # 2 x the matmul parameters a token uses up to the final norm (its top-k experts included)
    head_flops_per_row: int  # 2 x the LM head's parameters, for each row that gets logits (a prefill's last token)
    attn_flops_per_pair: int  # per (query, key) pair over all layers: QK^T and PV
    expert_bytes: int = 0  # one expert of one MoE layer
    moe_layers: int = 0
    num_experts: int = 0
    top_k: int = 0

    def experts_touched(self, num_tokens: int) -> float:
        """Experts one MoE layer reads for num_tokens tokens, expected under uniform routing: E (1 - (1 - k/E)^n)
        (k at one token, about all of them at large batches)."""
        if not self.moe_layers:
            return 0.0
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** num_tokens)

    def forward(self, num_tokens: int, kv_tokens: int, query_key_pairs: int,
                rows: int | None = None) -> tuple[float, float]:
        """(bytes, FLOPs) of one forward: weights (the experts it touches) + KV read and written; matmuls +
        attention + the LM head on rows rows (default num_tokens, a decode's; a prefill computes logits for each
        request's last token only: counted for every prompt token, gemma3-270m's 262144-row head made a 512-token
        CPU prefill 2.2 times faster than its floor)."""
        experts = self.moe_layers * self.experts_touched(num_tokens) * self.expert_bytes
        nbytes = self.weight_bytes + experts + self.kv_bytes_per_token * (kv_tokens + num_tokens)
        rows = num_tokens if rows is None else rows
        flops = (self.flops_per_token * num_tokens + self.head_flops_per_row * rows
                 + self.attn_flops_per_pair * query_key_pairs)
        return nbytes, flops


def model_cost(engine: Engine) -> ModelCost:
    mc = engine.config.model_config
    item = engine.dtype.itemsize
    params = sum(p.numel() for p in engine.model.parameters())
    embed = engine.model.model.embed_tokens.weight.numel()
    stacks = [p for n, p in engine.model.named_parameters() if ".mlp.experts." in n]  # [E, ...] per MoE layer
    moe_layers = sum(mc.moe_layers)
    per_expert = sum(p[0].numel() for p in stacks) // max(moe_layers, 1)
    # an untied embedding reads only the looked-up rows
    read = params - sum(p.numel() for p in stacks) - (0 if mc.tie_word_embeddings else embed)
    head = embed if engine.model.lm_head is None else engine.model.lm_head.weight.numel()
    return ModelCost(
        weight_bytes=read * item,
        kv_bytes_per_token=2 * mc.num_layers * engine.num_kv_heads * mc.head_dim * item,
        flops_per_token=2 * (read - head + moe_layers * mc.num_experts_per_tok * per_expert),
        head_flops_per_row=2 * head,
        attn_flops_per_pair=4 * mc.num_layers * engine.num_qo_heads * mc.head_dim,
        expert_bytes=per_expert * item, moe_layers=moe_layers, num_experts=mc.num_experts,
        top_k=mc.num_experts_per_tok,
    )
