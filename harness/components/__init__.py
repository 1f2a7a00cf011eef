"""Component checks: each fast kernel of the engine against its reference on identical inputs.

What they prove, case by case: on the same bf16 inputs (the same paged pool, page table and q; the same activations),
the kernel's output is within ERROR_FACTOR of the reference's own error, both measured against a float64 result
computed from those inputs. Attention: FlashInferBackend against TorchBackend through the engine's metadata path
(prefill, extend over a cached prefix, decode eager and replayed from a CUDA graph; page sizes 1 / 4 / 16; plain and
tensor-core decode; sliding windows; head_dim 64 / 128 / 256). The KV append: bitwise equal to the torch write,
padding rows only on the dummy page. The fused ops: rmsnorm, fused_add_rmsnorm, per-head q/k rmsnorm and RoPE in
place on strided views (leaving the rest of the buffer bitwise alone), silu / gelu-tanh-and-mul.
A Fault of size e planted in the kernel under test measures how small an error each check sees.
"""

from harness.components.attention import check_attention, check_kv_append
from harness.components.measure import ERROR_FACTOR, CheckResult, Errors, Fault, measure
from harness.components.ops import OpCase, check_op, op_cases
from harness.components.paged import AttentionCase, attention_cases

__all__ = ["ERROR_FACTOR", "AttentionCase", "CheckResult", "Errors", "Fault", "OpCase", "attention_cases",
           "check_attention", "check_kv_append", "check_op", "measure", "op_cases"]
