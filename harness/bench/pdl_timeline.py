"""python -m harness.bench.pdl_timeline [--n N --k K --calls C]: when each call of a chain of dependent kernels
starts, is released from its wait and ends (CUDA, sm90 and later), which is what bounds the bench's M = 1 GEMM table.

The table times a chain of one-row GEMVs in one CUDA graph, each on its own copy of the weight, each launched under
programmatic dependent launch (PDL): a call may start while the one before it runs, load its weight, then wait for
that call to end before it reads x. Here a GEMV of the same shape (o_proj's by default) stamps the global timer in
every program as it starts, after its wait and as it ends, and each call's span is read off the stamps: first start,
first release, last end. Per variant: the time a call (CUDA events over the graph), the most calls in flight at once,
the median time from a call's end to the next call's release (the wait's own latency) and from a call's release to
its end, and the smallest release after the end of the call before (negative only where nothing waits).

Variants: the skinny GEMM's order (W before the wait, x after), the same without x (the floor of any kernel that
holds its weight before the wait: only the sum and the store follow it), no weight (the floor of a kernel that
moves nothing), and no wait (calls unordered: the weights' stream alone). The timer ticks in steps of a fraction of
a microsecond (printed), so the medians are that coarse.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Dict

import torch

from harness.bench.gemm import _time_per_call, weight_copies
from harness.report import markdown_table

# name: (load W before the wait, wait, load x after it)
VARIANTS = {"W, wait, x (the skinny GEMM's order)": (True, True, True),
            "W, wait, no x": (True, True, False),
            "no W, wait, x": (False, True, True),
            "W, no wait, x (unordered)": (True, False, True)}


def timeline(variant: str, n: int = 1024, k: int = 2048, calls: int = 24, block_n: int = 2,
             warps: int = 4) -> Dict[str, Any]:
    """One variant's chain of `calls` GEMVs (n x k, bf16, k a power of two) on cuda:0, timed and stamped."""
    from harness.bench.pdl_timeline_kernel import timeline_kernel

    load_w, wait, load_x = VARIANTS[variant]
    copies = weight_copies(n * k * 2, 0)
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
    x = torch.randn(k, dtype=torch.bfloat16, device="cuda")
    ys = torch.empty(calls, n, dtype=torch.bfloat16, device="cuda")
    programs = n // block_n
    stamps = torch.zeros(calls, programs, 3, dtype=torch.int64, device="cuda")

    def call(i: int) -> None:
        timeline_kernel[(programs,)](x, weights[i % copies], ys[i], stamps[i], k, BLOCK_N=block_n, BLOCK_K=k,
                                     LOAD_W=load_w, WAIT=wait, LOAD_X=load_x, num_warps=warps, launch_pdl=True)

    # the bench's chain timing; the stamps are its last replay's
    per_call = _time_per_call([lambda _, i=i: call(i) for i in range(calls)], x, calls)
    torch.cuda.synchronize()
    t = stamps.cpu().double() / 1e3  # ns -> us
    t -= t[:, :, 0].min()
    start, release, end = t[:, :, 0].min(1).values, t[:, :, 1].min(1).values, t[:, :, 2].max(1).values
    ticks = t.flatten().unique().diff()
    inner = range(2, calls - 2)  # the chain's steady state
    return {"variant": variant, "N": n, "K": k, "programs": programs, "us_a_call": per_call * 1e6,
            "most_calls_in_flight": max(int(((start <= start[i]) & (end > start[i])).sum()) for i in range(calls)),
            "end_to_next_release_us": statistics.median(float(release[i] - end[i - 1]) for i in inner),
            "release_to_end_us": statistics.median(float(end[i] - release[i]) for i in inner),
            "min_release_after_previous_end_us": float((release[1:] - end[:-1]).min()),
            "timer_step_us": float(ticks.min()) if len(ticks) else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.bench.pdl_timeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1024, help="rows of W (default 1024: qwen3-0.6b's o_proj)")
    parser.add_argument("--k", type=int, default=2048, help="columns of W, a power of two (default 2048)")
    parser.add_argument("--calls", type=int, default=24)
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("pdl_timeline needs a CUDA GPU of sm90 or later (programmatic dependent launch)")
    if args.k & (args.k - 1):
        raise SystemExit(f"--k must be a power of two, got {args.k}")
    rows = [timeline(v, args.n, args.k, args.calls) for v in VARIANTS]
    print(f"# A PDL chain of one-row GEMVs on the {torch.cuda.get_device_name()} (torch {torch.__version__})\n")
    print(markdown_table([{key: round(v, 2) if isinstance(v, float) else v for key, v in r.items()} for r in rows]))


if __name__ == "__main__":
    main()
