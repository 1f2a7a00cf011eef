"""The GEMMs of a batch-1 decode step one at a time (CUDA): each projection of a decoder layer and the LM head at
M = 1, through the engine's own product and through cuBLAS, with the bandwidth each reaches reading its weight.

At a few microseconds a call, launches would be what a loop of calls times, so the calls run back to back inside one
CUDA graph, timed with CUDA events. Each call reads a different copy of the weight, enough copies to exceed the L2
cache four times over: a decode step reads every weight once, from memory, never from L2.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Dict, List

import torch
import torch.nn.functional as F

from harness.bench.limits import Limits
from harness.bench.profile import replay_seconds
from harness.report import markdown_table

MIN_CALLS = 24  # calls per graph replay
REPLAYS = 20
TARGET_FRACTION = 0.6  # of the measured bandwidth, at M = 1 on every shape


def _shapes(engine: Any) -> List[tuple]:
    """(name, module or weight, bias) for each GEMM of a decode step: layer 0's projections and the LM head."""
    layer, model = engine.model.model.layers[0], engine.model
    head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    modules = [("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj)]
    if hasattr(layer.mlp, "gate_up_proj"):  # a dense MLP (MoE experts run grouped GEMMs, not these)
        modules += [("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)]
    return [(name, m.weight, getattr(m, "bias", None)) for name, m in modules] + [("lm_head", head, None)]


def weight_copies(nbytes: int, device: Any) -> int:
    """Copies of a weight of nbytes that together exceed four times the device's L2 cache."""
    return max(1, -(-4 * torch.cuda.get_device_properties(device).L2_cache_size // nbytes))


def _calls(weight: torch.Tensor, bias: Any, copies: int, fn: Callable) -> List[Callable[[torch.Tensor], Any]]:
    """copies calls of fn(x, w, b), each over its own copy of the weight."""
    out = []
    for _ in range(copies):
        w = weight.detach().clone()
        out.append(lambda x, w=w: fn(x, w, bias))
    return out

def _time_per_call(calls: List[Callable[[torch.Tensor], Any]], x: torch.Tensor, n: int) -> float:
    """Seconds per call: n calls cycling over the copies, captured in one graph, median over replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # warm-up outside the capture (kernel selection, lazy workspaces)
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            calls[i % len(calls)](x)
    graph.replay()
    return statistics.median(replay_seconds(graph, REPLAYS)) / n


@torch.inference_mode()
def gemm_rows(model_name: str, engine: Any, limits: Limits) -> List[Dict[str, Any]]:
    """Each shape through the engine's own product (its ops' linear: the skinny GEMM on the fused path) and through
    cuBLAS (F.linear), in the same run on the same copies."""
    device, ops = engine.device, engine.model.ops
    rows = []
    for name, weight, bias in _shapes(engine):
        nbytes = weight.numel() * weight.element_size()
        copies = weight_copies(nbytes, device)
        x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=device)
        secs = {}
        for path, fn in (("engine", ops.linear), ("cublas", F.linear)):
            calls = _calls(weight, bias, copies, fn)
            secs[path] = _time_per_call(calls, x, max(MIN_CALLS, copies))
            del calls
            torch.cuda.empty_cache()
        rows.append({"model": model_name, "gemm": name, "M": 1, "N": weight.shape[0], "K": weight.shape[1],
                     "weight_MB": nbytes / 1e6, "copies": copies, "us": secs["engine"] * 1e6,
                     "GBps": nbytes / secs["engine"] / 1e9,
                     "fraction_of_bandwidth": nbytes / secs["engine"] / limits.bandwidth,
                     "cublas_us": secs["cublas"] * 1e6,
                     "cublas_fraction": nbytes / secs["cublas"] / limits.bandwidth})
    return rows


def gemm_section(gemms: List[Dict[str, Any]]) -> str:
    if not gemms:
        return ""
    return ("## GEMMs at M = 1\n"
            "Each GEMM of a batch-1 decode step alone (layer 0's projections, the LM head), through the "
            "engine's own product (`us`, `GBps`, `fraction_of_bandwidth`: the skinny GEMM on the fused path) and "
            "through cuBLAS (`cublas_us`, `cublas_fraction`: F.linear), on the same weight copies in the same run: "
            f"{MIN_CALLS} or more calls back to back in one CUDA graph, each on its own copy of the weight "
            "(copies: enough to exceed four times the L2 cache), median over "
            f"{REPLAYS} replays; GBps = weight bytes / time, beside the bandwidth measured in this run.\n\n"
            f"{markdown_table(gemms)}\n")
