"""Long prompts in the bench: time to first token of prompts prefilled in chunks, and the inter-token latency of
running requests while such a prompt arrives, beside the same without it.

One engine for these, whose forward budget (EngineConfig.max_prefill_tokens) is the driver's default prefill budget
(BenchSpec.long_budget, 4096 on CUDA): its memory plan reserves activations for chunks of that many tokens, not for
the longest prompt, and every prompt over the budget is prefilled in chunks (harness.driver). A time to first token
is set beside the compute floor of one causal prefill of its length (its matmuls and attention's n (n + 1) / 2 query
and key pairs, over the matmul rate measured in the run): the chunks add no FLOPs to it.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Dict, List

import torch
from tqdm import tqdm

from engine import Engine, EngineConfig
from engine.distributed import DistributedInfo
from harness import zoo
from harness.bench.limits import Limits, model_cost
from harness.bench.workloads import BenchSpec, engine_interleaved, engine_ttft
from harness.driver import Driver

PREFILL_FRACTION = (32768, 0.60)  # the prefill at 32k tokens >= 60% of its compute floor
ITL_RATIO = 3.0  # p99 inter-token latency while a long prompt arrives <= 3x the median step without it

Row = Callable[..., Dict[str, Any]]  # harness.bench.run._row


def long_engine(model: str, device: str, dtype: str, spec: BenchSpec) -> Engine:
    longest = max([*spec.long_prompts, spec.itl[2] if spec.itl else 0])
    return Engine(EngineConfig(
        model_path=str(zoo.path(model)), tp_info=DistributedInfo(0, 1), dtype=getattr(torch, dtype), device=device,
        max_running_req=(spec.itl[0] if spec.itl else 1) + 1, use_dummy_weight=not zoo.MODELS[model].has_weights,
        max_seq_len_override=longest + 64, max_prefill_tokens=spec.long_budget))


def percentile(xs: List[float], q: float) -> float:
    """The q-th percentile (0 < q < 100) of the samples, linear between order statistics."""
    if len(xs) < 2:
        return xs[0] if xs else float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q) - 1]


def bench_long(model: str, device: str, dtype: str, spec: BenchSpec, limits: Limits, row: Row) -> List[Dict]:
    """The rows: ttft_long at each long length; itl (the running requests alone) and itl_arriving (while the long
    prompt arrives: p50 in median_s, p99 in p99_s) with their p99; ttft_arriving, that prompt's chunks while they
    decode."""
    engine = long_engine(model, device, dtype, spec)
    rows: List[Dict[str, Any]] = []
    try:
        cost, vocab = model_cost(engine), engine.config.model_config.vocab_size
        driver = Driver(engine, max_prefill_tokens=spec.long_budget)
        for n in tqdm(spec.long_prompts, desc=f"{model} long prompts: time to first token"):
            secs = engine_ttft(driver, n, vocab, spec.repeats)
            rows.append(row(model, "engine", "ttft_long", 1, n, secs, n, cost, limits, (n, 0, n * (n + 1) // 2)))
        if spec.itl:
            bs, ctx, long_len = spec.itl
            run = engine_interleaved(driver, bs, ctx, long_len, vocab)
            for workload, gaps, length in (("itl", run.alone, ctx), ("itl_arriving", run.arriving, long_len)):
                rows.append({"model": model, "runner": "engine", "workload": workload, "batch_size": bs,
                             "length": length, "median_s": statistics.median(gaps), "p10_s": percentile(gaps, 10),
                             "p90_s": percentile(gaps, 90), "p99_s": percentile(gaps, 99), "samples": len(gaps),
                             "tokens_per_s": bs / statistics.median(gaps)})
            rows.append({"model": model, "runner": "engine", "workload": "ttft_arriving", "batch_size": 1,
                         "length": long_len, "median_s": run.long_ttft, "samples": 1,
                         "tokens_per_s": long_len / run.long_ttft})
    finally:
        engine.shutdown()
    return rows


def long_context_targets(rows: List[Dict[str, Any]], model: str) -> List[Dict[str, Any]]:
    """Where the long-prompt targets stand: the prefill's fraction of its compute floor at 32k tokens, the p99
    inter-token latency of running requests while a long prompt arrives against their median step without it; the
    time to first token at every long length."""
    mine = {(r["workload"], r.get("length")): r for r in rows if r["model"] == model and r["runner"] == "engine"}
    out = []
    ttft = sorted((n, r) for (w, n), r in mine.items() if w == "ttft_long")
    if ttft:
        out.append({"model": model, "target": "time to first token of long prompts (chunked at the default budget)",
                    "reached": ", ".join(f"{n}: {r['median_s'] * 1e3:.1f} ms ({100 * r['fraction_of_floor']:.0f}% "
                                         f"of its floor)" for n, r in ttft), "met": "-"})
    n, fraction = PREFILL_FRACTION
    if ("ttft_long", n) in mine:
        got = mine[("ttft_long", n)]["fraction_of_floor"]
        out.append({"model": model, "target": f"prefill of {n} tokens >= {100 * fraction:.0f}% of its compute floor",
                    "reached": f"{100 * got:.0f}%", "met": got >= fraction})
    alone = next((r for (w, _), r in mine.items() if w == "itl"), None)
    busy = next((r for (w, _), r in mine.items() if w == "itl_arriving"), None)
    if alone and busy and not math.isnan(busy["p99_s"]):
        ratio = busy["p99_s"] / alone["median_s"]
        out.append({"model": model, "target": f"p99 inter-token latency of {busy['batch_size']} running requests "
                    f"while a {busy['length']}-token prompt arrives <= {ITL_RATIO:.0f}x their step without it",
                    "reached": f"{ratio:.1f}x (p50 {busy['median_s'] * 1e3:.2f} ms, p99 {busy['p99_s'] * 1e3:.2f} "
                               f"ms; alone p50 {alone['median_s'] * 1e3:.2f} ms, p99 {alone['p99_s'] * 1e3:.2f} ms)",
                    "met": ratio <= ITL_RATIO})
    return out
