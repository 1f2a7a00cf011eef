"""python -m harness.bench.deep_chunk [--heads 16 --kv-heads 8 --head-dim 128]: one layer's attention of a chunk of
c query tokens over d cached keys (causal, bf16, pages of 1 token) through FlashInfer's paged prefill, FA3 (the
engine's: each query tile of a head gets all its keys, on one SM) against FA2 (its plan splits the keys where the
tiles do not fill the SMs). This is the floor a step budget cannot go below while a deep prompt is chunked beside
running decodes (harness/step_budget.py, per_key; docs/bench.md, Long prompts). CUDA events, median of 5 x 20 calls.
"""

from __future__ import annotations

import argparse
import statistics
from typing import List

import torch

from harness import EXIT_USER_ERROR, UserError, check_device
from harness.report import text_table

CHUNKS = (64, 256, 1024, 4096)
DEPTHS = (4096, 16384, 32512)


def time_prefill(backend: str, chunk: int, depth: int, heads: int, kv_heads: int, head_dim: int,
                 workspace: torch.Tensor) -> float:
    """Milliseconds a call: one request of `chunk` new tokens over `depth` cached ones."""
    import flashinfer

    n, dev = depth + chunk, workspace.device
    k = torch.randn(n, 1, kv_heads, head_dim, dtype=torch.bfloat16, device=dev)
    v, q = torch.randn_like(k), torch.randn(chunk, heads, head_dim, dtype=torch.bfloat16, device=dev)
    i32 = dict(dtype=torch.int32, device=dev)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
    w.plan(torch.tensor([0, chunk], **i32), torch.tensor([0, n], **i32), torch.arange(n, **i32),
           torch.tensor([1], **i32), heads, kv_heads, head_dim, 1, causal=True, q_data_type=torch.bfloat16)
    for _ in range(3):
        w.run(q, (k, v))
    times: List[float] = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            w.run(q, (k, v))
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 20)
    return statistics.median(times)


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.bench.deep_chunk", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--heads", type=int, default=16, help="query heads (default: qwen3-0.6b's)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args(argv)
    if not args.device.startswith("cuda"):
        p.error("--device: FlashInfer's prefill kernels run on cuda only")
    try:
        check_device(args.device, flashinfer=True)
    except UserError as e:
        print(f"error: {e}")
        return EXIT_USER_ERROR
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=args.device)
    rows = []
    for depth in DEPTHS:
        for chunk in CHUNKS:
            ms = {b: time_prefill(b, chunk, depth, args.heads, args.kv_heads, args.head_dim, workspace)
                  for b in ("fa3", "fa2")}
            flops = 4 * chunk * (depth + chunk / 2) * args.heads * args.head_dim
            rows.append({"query tokens": chunk, "cached keys": depth, "fa3 ms": round(ms["fa3"], 3),
                         "fa2 ms": round(ms["fa2"], 3), "fa3 TFLOP/s": round(flops / ms["fa3"] / 1e9, 1),
                         "fa2 TFLOP/s": round(flops / ms["fa2"] / 1e9, 1)})
    props = torch.cuda.get_device_properties(args.device)
    print(f"{props.name}, {props.multi_processor_count} SMs")
    print(text_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
