"""The serving benchmark's metrics, with the names and definitions of vLLM's (`vllm bench serve`,
vllm/benchmarks/serve.py calculate_metrics), so that the numbers can be set beside its:

- TTFT, time to first token: from the request's sending to its first chunk of tokens.
- TPOT, time per output token: (E2EL - TTFT) / (output tokens - 1), of each request with more than one token.
- ITL, inter-token latency: the gaps between a request's consecutive chunks, every request's pooled (a server that
  sends several tokens in a chunk gives one gap for them, as vLLM counts it; SGLang's bench spreads it over them).
- E2EL, end-to-end latency: from the sending to the last chunk.
- each as mean, median, std and p90 / p99 (numpy's percentile: linear between order statistics), in ms;
- request_throughput (completed requests / duration), output_throughput (output tokens / duration),
  total_token_throughput ((input + output tokens) / duration); duration: from the trace's start to the last
  request's last chunk;
- request_goodput: the requests a second that meet every SLO given (ttft, tpot, e2el in ms; a request of one token
  counts its TPOT as 0, as vLLM does).
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np

from harness.bench.arrivals import Timing

PERCENTILES = (90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")
SLO_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(items: Sequence[str]) -> Dict[str, float]:
    """vLLM's --goodput: KEY:MS pairs (ttft, tpot, e2el) -> {key: milliseconds}; ValueError says what is wrong."""
    out: Dict[str, float] = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS or not value:
            raise ValueError(f"--goodput {item}: give KEY:MS with KEY one of {', '.join(SLO_KEYS)} (e.g. ttft:500)")
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item}: {value!r} is not a number of milliseconds") from None
        if out[key] <= 0:
            raise ValueError(f"--goodput {item}: an SLO must be above 0 ms")
    return out


def _summary(name: str, xs: List[float]) -> Dict[str, float]:
    a = np.asarray(xs or [0.0]) * 1e3  # vLLM reports 0 for a metric with no samples
    out = {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a)),
           f"std_{name}_ms": float(a.std())}
    out.update({f"p{p}_{name}_ms": float(np.percentile(a, p)) for p in PERCENTILES})
    return out


def per_request(t: Timing) -> Dict[str, float]:
    """One completed request's ttft, tpot (0 for a single token), e2el (seconds) and output tokens."""
    ttft, e2el, n = t.times[0] - t.sent, t.times[-1] - t.sent, sum(t.tokens)
    return {"ttft": ttft, "e2el": e2el, "tpot": (e2el - ttft) / (n - 1) if n > 1 else 0.0, "output": n}


def metrics(timings: Sequence[Timing], slo_ms: Dict[str, float] | None = None) -> Dict[str, float]:
    """The run's metrics (module docstring) from every request's timing."""
    done = [t for t in timings if not t.error and t.times]
    reqs = [per_request(t) for t in done]
    duration = max((t.times[-1] for t in done), default=0.0)
    outputs = sum(r["output"] for r in reqs)
    inputs = sum(t.prompt_len for t in done)
    slo = {k: v / 1e3 for k, v in (slo_ms or {}).items()}
    good = sum(all(r[k] <= v for k, v in slo.items()) for r in reqs) if slo else 0
    per = max(duration, 1e-9)
    out = {"completed": len(done), "failed": len(timings) - len(done), "total_input": inputs,
           "total_output": outputs, "duration_s": duration, "request_throughput": len(done) / per,
           "request_goodput": good / per if slo else float("nan"), "good_requests": good,
           "output_throughput": outputs / per, "total_token_throughput": (inputs + outputs) / per}
    out.update(_summary("ttft", [r["ttft"] for r in reqs]))
    out.update(_summary("tpot", [r["tpot"] for r in reqs if r["output"] > 1]))
    out.update(_summary("itl", [b - a for t in done for a, b in zip(t.times, t.times[1:])]))
    out.update(_summary("e2el", [r["e2el"] for r in reqs]))
    return out
