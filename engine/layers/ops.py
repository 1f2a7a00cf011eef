"""The small ops and GEMMs of a decoder layer, in implementations chosen once per engine (EngineConfig.ops_backend).

TorchOps is the readable definition, with Hugging Face's numerics (the reference on any device and dtype);
OneDNNOps (the CPU, fp32) is TorchOps whose GEMMs run through oneDNN on weights laid out for it once, at load, and
whose norms, RoPE and activation are one-pass C++ kernels;
FlashInferOps replaces each op by one fused CUDA kernel for half precision; BatchInvariantOps (batch_invariant) is
TorchOps whose GEMMs and activation give a row the same bits in any batch (engine/batch_invariant.py). Layers hold the chosen object and never
branch on the device. Ops ending in `_` work in place on views of the merged q/k/v projection, so the fused path
writes no copies of q and k.

Numerics that differ on the fused path, each within bf16 rounding: RMSNorm multiplies the weight in fp32 before one
rounding (HF Llama casts first), fused_add_rmsnorm normalizes the unrounded sum, RoPE rotates HF's rounded cos/sin in
fp32 and rounds once (HF rounds after each product), the gated activations round once, the skinny and narrow GEMMs
sum in fp32 in their own orders (cuBLAS's is another); the fused q/k norm + RoPE + KV store rounds where FlashInfer's
norm and RoPE kernels do (after the norm, after the rotation) and sums the squares in its own order. Gemma's per-head
q/k norms stay on the reference path (FlashInfer's gemma_rmsnorm has no [N, H, D] form; the fused kernel knows w).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import batch_invariant
from engine.core import forwarding_prefill
from engine.kernels import cpu_kernels, narrow_gemm, qk_rope_store, skinny_gemm
from engine.kvcache import KVCachePool
from engine.utils.device import has_flashinfer, has_triton

OPS_BACKENDS = ("torch", "onednn", "flashinfer")


class TorchOps:
    """The readable definition of each op, with HF's numerics."""

    def rope_table(self, table: torch.Tensor, model_dtype: torch.dtype) -> torch.Tensor:
        """The cos | sin table [max_pos, D] in fp32 -> what rope_ reads: HF casts cos/sin to the model dtype."""
        return table.to(model_dtype)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """A GEMM's weight [O, K] as loaded -> the weight linear and lm_head read (done once, at load)."""
        return weight

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
        """x [..., D] -> x / rms(x) * (offset + weight). offset 0 (Llama, Qwen): computed in fp32, cast back before
        the weight multiply; offset 1 (Gemma stores w - 1): the weight product in fp32 too, then cast."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        if offset:
            return (h * (offset + weight.float())).to(x.dtype)
        return weight * h.to(x.dtype)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                    offset: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(x + residual), x + residual); the sum is rounded to the model dtype first, as HF adds."""
        residual = x + residual
        return self.rmsnorm(residual, weight, eps, offset), residual

    def head_rmsnorm_(self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> None:
        """Per-head RMSNorm of x [N, H, D] (a view), in place."""
        x.copy_(self.rmsnorm(x, weight, eps, offset))

    def rope_(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, table: torch.Tensor) -> None:
        """Rotate-half RoPE of q [N, Hq, D] and k [N, Hkv, D] (views) in place; table [max_pos, D] holds
        cos | sin of the D / 2 frequencies. Bitwise HF's q * cos + rotate_half(q) * sin in the model dtype."""
        cos, sin = table[positions].unsqueeze(1).chunk(2, dim=-1)
        for x in (q, k):
            x1, x2 = x.chunk(2, dim=-1)
            rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
            x.copy_(rotated)

    def qk_rope_store_(self, positions: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor,
                       norms: tuple | None, pool: KVCachePool, layer_id: int, out_loc: torch.Tensor) -> None:
        """What attention needs before it attends: per-head RMSNorm of q and k (norms: the (q_norm, k_norm) RMSNorm
        modules, None without), RoPE of q and k, then K and V into the pool at slots out_loc [N]. q [N, Hq, D] and
        the K of kv [N, 2, Hkv, D] (views) are left normalized and rotated in place: kv then holds what the pool got
        (a prompt's attention may read it there)."""
        k = kv[:, 0]
        if norms is not None:
            for x, norm in zip((q, k), norms):
                self.head_rmsnorm_(x, norm.weight, norm.eps, norm.offset)
        self.rope_(positions, q, k, table)
        pool.store_kv(kv, out_loc, layer_id)

    def act_and_mul(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        """[N, 2I] (gate | up) -> act(gate) * up [N, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               act: str | None = None) -> torch.Tensor:
        """x [N, K] @ weight [O, K]^T (+ bias): every projection. act: x is [N, 2K], gate | up, and the input is
        act_and_mul(x, act) (the MLP's down projection)."""
        return self.gemm(x if act is None else self.act_and_mul(x, act), weight, bias)

    def lm_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [rows, H] @ weight [vocab, H]^T: the logits of the rows a batch asks for."""
        return self.gemm(x, weight)

    def gemm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The product of linear and lm_head on a weight as pack left it."""
        return F.linear(x, weight, bias)

    def router(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [N, H] @ weight [E, H]^T: an MoE layer's router logits, in the model dtype as HF computes them."""
        return F.linear(x, weight)


class OneDNNOps(TorchOps):
    """TorchOps whose RMSNorms (with the residual's add), RoPE and gated activation run as one-pass C++ kernels
    (kernels/cpu_kernels.py, where a compiler builds them; the add and norm in place, as FlashInferOps's) and whose
    GEMMs (the projections and the LM head) run through oneDNN's inner product on weights reordered once into its
    blocked layout, as vLLM's CPU build runs them. MKL's sgemm, which F.linear calls in fp32, reaches
    less of this CPU at decode's few rows: on the AMD EPYC host (AVX-512, 1 thread, SmolLM2's shapes) 1.3-1.6x the
    time at 8 rows, 2.3x on the LM head, 1.1-1.2x at 128-512 (docs/perf-log.md, 2026-12-07). Each row's K-sum
    still follows the row count and the threads, as MKL's does (docs/parity-determinism.md)."""

    def __init__(self) -> None:
        self.kernels = cpu_kernels.available()  # norms, RoPE and the activation in one pass each (kernels/cpu_ops.cpp)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight)  # an opaque tensor; .to_dense() gives [O, K] back

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
        if not self.kernels or x.stride(-1) != 1:
            return super().rmsnorm(x, weight, eps, offset)
        return cpu_kernels.rmsnorm(x, weight, eps, offset)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                    offset: float) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.kernels or not (x.is_contiguous() and residual.is_contiguous()):
            return super().add_rmsnorm(x, residual, weight, eps, offset)
        cpu_kernels.add_rmsnorm_(x, residual, weight, eps, offset)  # in place, as FlashInferOps's
        return x, residual

    def head_rmsnorm_(self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> None:
        if not self.kernels:
            return super().head_rmsnorm_(x, weight, eps, offset)
        cpu_kernels.rmsnorm(x, weight, eps, offset, out=x)

    def rope_(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, table: torch.Tensor) -> None:
        if not self.kernels:
            return super().rope_(positions, q, k, table)
        cpu_kernels.rope_(positions, q, table)
        cpu_kernels.rope_(positions, k, table)

    def act_and_mul(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        return cpu_kernels.act_and_mul(gate_up, act) if self.kernels else super().act_and_mul(gate_up, act)

    def gemm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class BatchInvariantOps(TorchOps):
    """TorchOps whose rows do not depend on their batch (EngineConfig.batch_invariant; engine/batch_invariant.py):
    every GEMM on the path whose rows do not depend on M, the activation on row blocks one thread computes."""

    def act_and_mul(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        return batch_invariant.act_and_mul(gate_up, act)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               act: str | None = None) -> torch.Tensor:
        return batch_invariant.linear(x if act is None else self.act_and_mul(x, act), weight, bias)

    def lm_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return batch_invariant.linear(x, weight)

    def router(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return batch_invariant.linear(x, weight)


class FlashInferOps(TorchOps):
    """One fused kernel per op (CUDA, fp16/bf16), FlashInfer's: rmsnorm, fused_add_rmsnorm, per-head rmsnorm on
    strided [N, H, D] views, RoPE from an fp32 cos/sin cache in place, silu/gelu-tanh-and-mul; and Triton's where it
    is installed: q/k norms, RoPE and the KV store in one kernel (kernels/qk_rope_store.py), a decode's projections and
    any LM head of at most 16 rows through the skinny GEMM (kernels/skinny_gemm.py); and on sm90 the narrow projections
    (N <= K) of up to 128 rows through a CUTLASS kernel built on first use (kernels/narrow_gemm.py)."""

    def __init__(self) -> None:
        import flashinfer

        self.fi = flashinfer
        self.triton = has_triton()

    def rope_table(self, table: torch.Tensor, model_dtype: torch.dtype) -> torch.Tensor:
        # the kernel reads an fp32 cache: give it HF's cos/sin values (rounded to the model dtype), so only the
        # rotation's rounding differs (once in fp32 here, after each product in HF)
        return table.to(model_dtype).float()

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
        return (self.fi.gemma_rmsnorm if _unit(offset) else self.fi.rmsnorm)(x, weight, eps)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                    offset: float) -> tuple[torch.Tensor, torch.Tensor]:
        # in place: residual becomes x + residual, x its normalized value
        (self.fi.gemma_fused_add_rmsnorm if _unit(offset) else self.fi.fused_add_rmsnorm)(x, residual, weight, eps)
        return x, residual

    def head_rmsnorm_(self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> None:
        if _unit(offset):  # FlashInfer's gemma_rmsnorm takes 2D input only: the reference does these heads
            x.copy_(TorchOps.rmsnorm(self, x, weight, eps, offset))
        else:
            self.fi.rmsnorm(x, weight, eps, out=x)

    def rope_(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, table: torch.Tensor) -> None:
        self.fi.apply_rope_with_cos_sin_cache_inplace(positions, q, k, q.shape[-1], table, is_neox=True)

    def qk_rope_store_(self, positions: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor,
                       norms: tuple | None, pool: KVCachePool, layer_id: int, out_loc: torch.Tensor) -> None:
        # one Triton kernel (kernels/qk_rope_store.py) for all of it, unless the norms are Gemma's (1 + w) or the
        # head size is not a power of two
        gemma = norms is not None and _unit(norms[0].offset)
        if not self.triton or gemma or not qk_rope_store.supports(q, kv):
            return super().qk_rope_store_(positions, q, kv, table, norms, pool, layer_id, out_loc)
        weights = (None, None) if norms is None else (norms[0].weight, norms[1].weight)
        qk_rope_store.qk_rope_store(positions, q, kv, table, *weights, 0.0 if norms is None else norms[0].eps,
                                    *pool.slots(layer_id), out_loc)

    def act_and_mul(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        return (self.fi.silu_and_mul if act == "silu" else self.fi.gelu_tanh_and_mul)(gate_up)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               act: str | None = None) -> torch.Tensor:
        # decode only: a prefill of a few tokens runs eagerly at M = its tokens but in a prefill graph at its
        # bucket's M (cuBLAS), and the two must agree bit for bit; a decode graph's M is the eager batch's bucket
        config = skinny_gemm.choose(x, weight) if self.triton and not forwarding_prefill() else None
        if config is None:
            if narrow_gemm.supports(x, weight, bias, act):  # o_proj and down up to 128 rows, on sm90
                return narrow_gemm.narrow_gemm(x if act is None else self.act_and_mul(x, act), weight)
            return super().linear(x, weight, bias, act)
        if act is not None and x.shape[0] > 1:
            # every program forms the activation of all M rows itself: measured in a qwen3-0.6b decode graph on the
            # H200, fusing it saves 41 us a step at one row and costs 64 us at four
            x, act = self.act_and_mul(x, act), None
        return skinny_gemm.skinny_gemm(x, weight, bias, config, act)

    def lm_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # unlike a layer's projections the LM head runs outside the prefill graphs, on the batch's own rows in the
        # eager and the graph forward alike, so a prefill's few rows take the skinny GEMM too (qwen3-0.6b's at one
        # row on the H200: 67.6 us against cuBLAS's 74.3, the bench's M = 1 table)
        config = skinny_gemm.choose(x, weight) if self.triton else None
        return super().lm_head(x, weight) if config is None else skinny_gemm.skinny_gemm(x, weight, config=config)


def _unit(offset: float) -> bool:
    assert offset in (0.0, 1.0), f"RMSNorm weight offset {offset}: the fused kernels know 0 and 1"
    return offset == 1.0


def resolve_ops_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """"auto" -> flashinfer on CUDA in half precision when it is installed (its kernels have no fp32), onednn on a
    CPU in fp32 where torch has oneDNN, torch else."""
    half = dtype in (torch.float16, torch.bfloat16)
    onednn = device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
    if name == "auto":
        return "flashinfer" if device.type == "cuda" and half and has_flashinfer() else "onednn" if onednn else "torch"
    if name not in OPS_BACKENDS:
        raise ValueError(f"unknown ops backend {name!r}; choose one of: auto, {', '.join(OPS_BACKENDS)}")
    if name == "flashinfer" and (device.type != "cuda" or not half):
        raise ValueError(f"the flashinfer ops need a CUDA device and fp16/bf16, got {device.type} {dtype}: "
                         "use ops_backend='torch'")
    if name == "onednn" and not onednn:
        raise ValueError(f"the onednn ops need a CPU, fp32 and torch built with oneDNN, got {device.type} {dtype}: "
                         "use ops_backend='torch'")
    return name


def create_ops(name: str, invariant: bool = False) -> TorchOps:
    if invariant:
        return BatchInvariantOps()
    return {"flashinfer": FlashInferOps, "onednn": OneDNNOps}.get(name, TorchOps)()
