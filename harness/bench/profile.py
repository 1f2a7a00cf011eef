"""Where a step's time goes: kernels per step (torch.profiler), the CUDA graph replay's GPU time (CUDA events), and the
host's time by part (the driver's own timers), from which the step's bound is named. Decode steps and prefills."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List

import torch

from harness.driver import StepRecord

HOST_PARTS = ("build", "plan", "sample_prep", "launch", "process")  # the host's own work in a step
# kernel name fragments -> what the kernel does (first match wins)
CATEGORIES = (("q/k norm + rope + kv write", ("qk_rope_store",)),
              ("attention", ("BatchDecode", "BatchPrefill", "PrefillWithKVCache", "MergeState", "Attention")),
              ("kv write", ("AppendPagedKV", "index_copy")), ("norm", ("RMSNorm",)), ("rope", ("Rotary",)),
              ("activation", ("act_and_mul",)), ("moe routing", ("gatherTopK", "SortKVInPlace")),
              ("gemm", ("nvjet", "gemm", "Gemm", "splitK", "cutlass", "sm90_xmma")))
COPY_PREFIXES = ("Memcpy", "Memset", "memcpy", "memset")
SPIN_CYCLES = 2_000_000  # about 1 ms of GPU clock: longer than the host takes to submit a graph


@dataclass
class ReplayProfile:
    replay_s: float  # median GPU time of one graph replay (CUDA events)
    replay_p10_s: float
    replay_p90_s: float
    kernels_per_step: float  # kernels launched by one replay (copies and memsets not counted)
    copies_per_step: float
    top_kernels: List[Dict[str, Any]] = field(default_factory=list)  # name, per step count, GPU us per step


def replay_seconds(graph: Any, repeats: int) -> List[float]:
    """GPU seconds of each of `repeats` replays of a CUDA graph, timed with CUDA events. A spin kernel ahead of the
    start event keeps the GPU busy while the host submits the graph (cudaGraphLaunch of a decode graph takes
    0.15-0.27 ms of host time on the H200's host, during which an idle GPU would already be timing), so the events
    time the graph's own execution."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def profile_replay(engine: Any, bs: int, repeats: int = 50, profiled: int = 10) -> ReplayProfile | None:
    """Replay the decode graph of size bs as the last step left it (same page lists, same lengths) on the engine's
    stream. None when no graph has that size."""
    graph = engine.graph_runner.graphs.get(bs)
    return None if graph is None else profile_graph(graph, repeats, profiled)


def profile_prefill(engine: Any, tokens: int, repeats: int = 20, profiled: int = 5) -> ReplayProfile | None:
    """Replay the prefill graph the last prefill replayed, as it planned it (its KV writes land where that prefill's
    did), which must have had `tokens` tokens. None when it ran eagerly."""
    runner = engine.graph_runner
    bucket = runner.prefill_bucket(tokens)
    if not bucket:
        return None
    assert runner.last_prefill is not None and runner.last_prefill[0] == bucket, (runner.last_prefill, tokens)
    return profile_graph(runner.prefill_graphs[runner.last_prefill], repeats, profiled)


def profile_graph(graph: Any, repeats: int, profiled: int) -> ReplayProfile:
    for _ in range(3):
        graph.replay()
    times = replay_seconds(graph, repeats)
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled):
            graph.replay()
        torch.cuda.synchronize()
    kernels, copies = defaultdict(lambda: [0, 0.0]), 0
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if evt.name.startswith(COPY_PREFIXES):
            copies += 1
            continue
        kernels[evt.name][0] += 1
        kernels[evt.name][1] += evt.time_range.elapsed_us()
    total = sum(c for c, _ in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:12]
    q = statistics.quantiles(times, n=10)
    return ReplayProfile(
        statistics.median(times), q[0], q[-1], total / profiled, copies / profiled,
        [{"kernel": name[:90], "per_step": c / profiled, "us_per_step": us / profiled} for name, (c, us) in top])


def host_parts(records: List[StepRecord]) -> Dict[str, float]:
    """Median seconds per part over the steps, the host's busy time (the parts it spends working) and the period."""
    out = {part: statistics.median(r.host.get(part, 0.0) for r in records) for part in HOST_PARTS + ("wait",)}
    out["host_busy"] = statistics.median(sum(r.host.get(p, 0.0) for p in HOST_PARTS) for r in records)
    out["period"] = statistics.median(r.seconds for r in records)
    return out


def prefill_bound(host: Dict[str, float], replay_s: float | None) -> str:
    """A prefill of one request runs alone: the host prepares it, the GPU runs it, the host waits for its token."""
    busy, largest = host["host_busy"], max(HOST_PARTS, key=lambda p: host[p])
    gpu = "eager" if replay_s is None else f"graph replay {replay_s * 1e3:.2f} ms"
    return (f"host busy {busy * 1e3:.2f} ms (largest: {largest} {host[largest] * 1e3:.2f} ms) + waiting "
            f"{host['wait'] * 1e3:.2f} ms; GPU: {gpu}")


def bound(host: Dict[str, float], replay_s: float | None) -> str:
    """Name what a step waits on, from the measurements: with overlap the step takes about max(host busy, GPU)."""
    busy = host["host_busy"]
    if replay_s is None:
        return f"host-bound (eager: the host launches every kernel; host busy {busy * 1e3:.2f} ms)"
    largest = max(HOST_PARTS, key=lambda p: host[p])
    if replay_s >= busy:
        return (f"GPU-bound: replay {replay_s * 1e3:.2f} ms >= host busy {busy * 1e3:.2f} ms "
                f"(largest host part: {largest} {host[largest] * 1e3:.2f} ms)")
    return (f"host-bound: host busy {busy * 1e3:.2f} ms > replay {replay_s * 1e3:.2f} ms "
            f"(largest part: {largest} {host[largest] * 1e3:.2f} ms)")


def by_category(kernels: List[Dict[str, Any]]) -> Dict[str, float]:
    """GPU us per step by what the kernels do (gemm, attention, norm, rope, activation, kv write, other)."""
    out: Dict[str, float] = defaultdict(float)
    for k in kernels:
        name = next((c for c, frags in CATEGORIES if any(f in k["kernel"] for f in frags)), "other")
        out[name] += k["us_per_step"]
    return dict(out)
