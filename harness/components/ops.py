"""The fused ops (engine/layers/ops.py) against the torch ops on the same inputs, both against the exact result.

Each op runs as the layers call it: the norms on [tokens, hidden], fused_add_rmsnorm in place on both operands, the
per-head q/k RMSNorm and RoPE in place on strided views of one merged q/k/v projection (what they must leave alone,
the rest of that buffer, is compared bitwise), RoPE reading the table the ops object itself builds from HF's angles;
qk_rope_store, the attention layer's whole preparation (norms, RoPE, K and V into a pool at their slots: on the fused
path one Triton kernel), with V's stored copy compared bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, List, Literal, Tuple

import torch

from engine.kvcache import KVCachePool
from engine.layers.ops import TorchOps, create_ops
from engine.layers.rotary import RotaryEmbedding
from engine.models.config import RotaryConfig
from harness.components import reference
from harness.components.measure import CheckResult, Fault, check_fault, measure, planted

OpName = Literal["rmsnorm", "add_rmsnorm", "head_rmsnorm", "rope", "qk_rope_store", "silu_and_mul",
                 "gelu_tanh_and_mul"]
EPS = 1e-6
HEADS = (8, 2)  # q and KV heads of the merged projection the per-head ops work on
MAX_POSITION = 4096
ROPE_BASE = {64: 1e6, 128: 1e6, 256: 1e4}  # Qwen3's base at the smaller head dims, Gemma 3's local base at 256


@dataclass(frozen=True)
class OpCase:
    op: OpName
    size: int  # hidden size (rmsnorm, add_rmsnorm), head_dim (head_rmsnorm, rope, qk_rope_store), intermediate
    offset: float = 0.0  # RMSNorm's weight offset: 1 for Gemma's (1 + w), FlashInfer's gemma_* kernels
    tokens: int = 37
    seed: int = 0

    @property
    def name(self) -> str:
        return f"{self.op}-{self.size}" + ("-offset1" if self.offset else "")


def op_cases() -> List[OpCase]:
    norms = [OpCase(op, h, off) for op in ("rmsnorm", "add_rmsnorm") for h in (256, 576, 2048) for off in (0.0, 1.0)]
    heads = [OpCase(op, d) for op in ("head_rmsnorm", "rope", "qk_rope_store") for d in (64, 128, 256)]
    acts = [OpCase(op, i) for op in ("silu_and_mul", "gelu_tanh_and_mul") for i in (512, 1536)]
    return norms + heads + acts


Outputs = Dict[str, torch.Tensor]


def _inputs(case: OpCase, device: torch.device) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(case.seed)

    def bf16(*shape: int, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std + mean).to(torch.bfloat16).to(device)

    n, s = case.tokens, case.size
    if case.op in ("rmsnorm", "add_rmsnorm"):
        return {"x": bf16(n, s, std=3.0), "residual": bf16(n, s, std=5.0),
                "weight": bf16(s, mean=0.0 if case.offset else 1.0, std=0.2)}
    if case.op in ("head_rmsnorm", "rope", "qk_rope_store"):
        positions = torch.randint(0, MAX_POSITION, (n,), generator=gen, dtype=torch.int32).to(device)
        return {"qkv": bf16(n, (HEADS[0] + 2 * HEADS[1]) * s, std=2.0), "q_weight": bf16(s, mean=1.0, std=0.2),
                "k_weight": bf16(s, mean=1.0, std=0.2), "positions": positions,
                "out_loc": torch.randperm(2 * n, generator=gen)[:n].to(device)}
    return {"gate_up": bf16(n, 2 * s, std=2.0)}


def _views(qkv: torch.Tensor, d: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, Hq, D], k [N, Hkv, D] (strided, as the decoder takes them) and the V columns they must not touch."""
    n, (hq, hkv) = qkv.shape[0], HEADS
    kv = qkv[:, hq * d:].view(n, 2, hkv, d)
    return qkv[:, : hq * d].view(n, hq, d), kv[:, 0], kv[:, 1]


def _table(case: OpCase, ops: TorchOps, device: torch.device, base_factor: float = 1.0) -> torch.Tensor:
    cfg = RotaryConfig(case.size, MAX_POSITION, ROPE_BASE[case.size] * base_factor, None)
    return RotaryEmbedding(cfg, MAX_POSITION, torch.bfloat16, device, ops).table


def _run(case: OpCase, ops: TorchOps, inp: Dict[str, torch.Tensor], fault: Fault | None) -> Outputs:
    """The op through `ops` on private copies of the inputs -> its outputs (and, for in-place ops, the untouched V)."""
    if case.op == "rmsnorm":
        return {"out": ops.rmsnorm(inp["x"].clone(), inp["weight"], EPS, case.offset)}
    if case.op == "add_rmsnorm":
        out, total = ops.add_rmsnorm(inp["x"].clone(), inp["residual"].clone(), inp["weight"], EPS, case.offset)
        return {"out": out, "residual": total}
    if case.op in ("head_rmsnorm", "rope"):
        qkv = inp["qkv"].clone()
        q, k, v = _views(qkv, case.size)
        if case.op == "head_rmsnorm":
            ops.head_rmsnorm_(q, inp["q_weight"], EPS, case.offset)
            ops.head_rmsnorm_(k, inp["k_weight"], EPS, case.offset)
        else:
            ops.rope_(inp["positions"], q, k, _table(case, ops, qkv.device, 1.0 + planted(fault, "rope_base")))
        return {"q": q, "k": k, "v": v}
    if case.op == "qk_rope_store":
        qkv, d = inp["qkv"].clone(), case.size
        q, kv = _views(qkv, d)[0], qkv[:, HEADS[0] * d:].view(qkv.shape[0], 2, HEADS[1], d)
        pool = KVCachePool(1, 2 * qkv.shape[0] + 1, 1, HEADS[1], d, qkv.device, qkv.dtype)
        norms = [SimpleNamespace(weight=inp[w], eps=EPS, offset=case.offset) for w in ("q_weight", "k_weight")]
        table = _table(case, ops, qkv.device, 1.0 + planted(fault, "rope_base"))
        ops.qk_rope_store_(inp["positions"], q, kv, table, norms, pool, 0, inp["out_loc"])
        slots = [c[inp["out_loc"]] for c in pool.slots(0)]
        return {"q": q, "k": slots[0], "v": slots[1]}
    return {"out": ops.act_and_mul(inp["gate_up"], "silu" if case.op == "silu_and_mul" else "gelu_tanh")}


def _exact(case: OpCase, inp: Dict[str, torch.Tensor]) -> Outputs:
    if case.op == "rmsnorm":
        return {"out": reference.rmsnorm(inp["x"], inp["weight"], EPS, case.offset)}
    if case.op == "add_rmsnorm":
        out, total = reference.add_rmsnorm(inp["x"], inp["residual"], inp["weight"], EPS, case.offset)
        return {"out": out, "residual": total}
    if case.op in ("silu_and_mul", "gelu_tanh_and_mul"):
        return {"out": reference.act_and_mul(inp["gate_up"], "silu" if case.op == "silu_and_mul" else "gelu_tanh")}
    q, k, _ = _views(inp["qkv"], case.size)
    if case.op == "head_rmsnorm":
        return {"q": reference.rmsnorm(q, inp["q_weight"], EPS, case.offset),
                "k": reference.rmsnorm(k, inp["k_weight"], EPS, case.offset)}
    # the cos/sin both implementations read: HF's fp32 angles rounded to bf16
    cos, sin = _table(case, TorchOps(), q.device)[inp["positions"].long()].chunk(2, dim=-1)
    if case.op == "qk_rope_store":  # normed, then rotated
        q, k = (reference.rmsnorm(x, inp[w], EPS, case.offset) for x, w in ((q, "q_weight"), (k, "k_weight")))
    return {"q": reference.rope(q, cos, sin), "k": reference.rope(k, cos, sin)}


def check_op(case: OpCase, device: torch.device | str = "cuda", kernel: str = "flashinfer",
             fault: Fault | None = None) -> CheckResult:
    """kernel: "flashinfer" (the fused ops, CUDA) or "torch" (the reference against itself: the CPU's check of the
    measuring code)."""
    rotates = case.op in ("rope", "qk_rope_store")
    check_fault(fault, ("output_scale", "rope_base") if rotates else ("output_scale",), case.op)
    device = torch.device(device)
    inp = _inputs(case, device)
    with torch.inference_mode():
        got = _run(case, create_ops(kernel), inp, fault)
        ref = _run(case, TorchOps(), inp, None)
        scale = planted(fault, "output_scale")
        if scale:
            for name, out in got.items():
                if name != "v":
                    out.mul_(1.0 + scale)
        exact = _exact(case, inp)
    result = CheckResult(case.op, case.name, fault)
    for name, want in exact.items():
        result.errors[name] = measure(got[name], ref[name], want)
    if "v" in got:  # in place on views the V columns of the merged buffer stay as they were; stored, V is a copy
        original = _views(inp["qkv"], case.size)[2]
        label = "v (stored)" if case.op == "qk_rope_store" else "v (untouched)"
        result.mismatches[label] = int((got["v"].view(torch.int16) != original.view(torch.int16)).sum())
    return result

