"""Long prompts in the bench: time to first token of prompts prefilled in chunks, and the inter-token latency of
running requests while such a prompt arrives, beside the same without it.

The arrival (arriving): bs requests of ctx-token prompts are served at once; once each has its first two tokens a
long prompt arrives (Driver.serve, every token timed as the host reads it). Measured: the running requests'
inter-token gaps while it arrives (each gap that ends after its arrival and starts before its first token), against
their gaps without it (the same requests alone, their first gap left out); its time to first token from its arrival,
against its own alone. Targets (the issue's, on an H100 or H200 with qwen3-0.6b): p99 of the first within ITL_RATIO of
the median of the second, and the prompt within TTFT_RATIO of its time alone.

One engine for these, whose forward budget (EngineConfig.max_prefill_tokens) is the driver's default prefill budget
(BenchSpec.long_budget, 4096 on CUDA): its memory plan reserves activations for chunks of that many tokens, not for
the longest prompt, and every prompt over the budget is prefilled in chunks (harness.driver). A time to first token
is set beside the compute floor of one causal prefill of its length (its matmuls and attention's n (n + 1) / 2 query
and key pairs, over the matmul rate measured in the run): the chunks add no FLOPs to it.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List

import torch
from tqdm import tqdm

from engine import Engine, EngineConfig
from engine.core import SamplingParams
from engine.distributed import DistributedInfo
from harness import zoo
from harness.bench.limits import Limits, model_cost
from harness.bench.workloads import BenchSpec, chunk_steps, engine_ttft, random_ids, settle
from harness.driver import Arrival, Driver, StepRecord
from harness.step_budget import StepCost

PREFILL_FRACTION = (32768, 0.60)  # the prefill at 32k tokens >= 60% of its compute floor
ITL_RATIO = 3.0  # p99 inter-token latency while a long prompt arrives <= 3x the median step without it
TTFT_RATIO = 1.5  # that prompt's time to first token <= 1.5x its own alone

Row = Callable[..., Dict[str, Any]]  # harness.bench.run._row


def long_engine(model: str, device: str, dtype: str, spec: BenchSpec) -> Engine:
    longest = max([*spec.long_prompts, spec.itl[2] if spec.itl else 0])
    return Engine(EngineConfig(
        model_path=str(zoo.path(model)), tp_info=DistributedInfo(0, 1), dtype=getattr(torch, dtype), device=device,
        max_running_req=(spec.itl[0] if spec.itl else 1) + 1, use_dummy_weight=not zoo.MODELS[model].has_weights,
        max_seq_len_override=longest + 64, max_prefill_tokens=spec.long_budget,
        prefill_graph_max_reqs=(spec.itl[0] if spec.itl else 1) + 1))  # a mixed step of them all replays a graph


def percentile(xs: List[float], q: float) -> float:
    """The q-th percentile (0 < q < 100) of the samples, linear between order statistics."""
    if len(xs) < 2:
        return xs[0] if xs else float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q) - 1]


@dataclass
class Arriving:
    alone: List[float]  # the running requests' inter-token gaps without the long prompt
    arriving: List[float]  # the same while it arrives
    ttft_alone: float  # the long prompt's time to first token alone
    ttft_arriving: float  # the same arriving beside them
    steps: List[StepRecord] = field(default_factory=list)  # the arriving run's steps that carried its chunks


class _Source:
    """first at once; then `later` once the running requests have read `after` tokens in all (seen())."""

    def __init__(self, first: List[Arrival], later: Arrival | None, after: int, seen: Callable[[], int]) -> None:
        self.first, self.later, self.after, self.seen = first, later, after, seen
        self.sent: Dict[int, float] = {}

    def take(self, finished: int, wait: bool) -> List[Arrival] | None:
        if self.first is not None:
            out, self.first = self.first, None
        elif self.later is not None and self.seen() >= self.after:
            out, self.later = [self.later], None
        else:
            return None if self.later is None else []
        self.sent.update((a.uid, time.perf_counter()) for a in out)
        return out


def _serve(driver: Driver, first: List[List[int]], steps: int, later: List[int] | None) -> tuple:
    """Token times per request and the sent times, `first` prompts decoding `steps` tokens, `later` (uid
    len(first)) arriving once they have two tokens each."""
    times: Dict[int, List[float]] = {}
    arrivals = [Arrival(i, p, SamplingParams(max_tokens=steps, ignore_eos=True)) for i, p in enumerate(first)]
    last = None if later is None else Arrival(len(first), later, SamplingParams(max_tokens=1, ignore_eos=True))
    source = _Source(arrivals, last, 2 * len(first), lambda: sum(map(len, times.values())))
    settle()
    driver.serve(source, on_token=lambda uid, tok, at: times.setdefault(uid, []).append(at))
    return times, source.sent


def arriving(driver: Driver, bs: int, ctx: int, long_len: int, vocab: int) -> Arriving:
    """The module docstring's scenario: bs requests of ctx tokens, a long_len-token prompt arriving; they decode for
    as many steps as its arrival takes and 16 more. Each run once to warm up, then measured."""
    shorts = [random_ids(ctx, vocab, seed=3000 + i) for i in range(bs)]
    long_prompt = random_ids(long_len, vocab, seed=long_len)
    steps = 2 + chunk_steps(driver, bs, ctx, long_len) * (1 if driver.mixed else 2) + 16
    runs = {}
    for name, (first, later) in (("alone", (shorts, None)), ("arriving", (shorts, long_prompt)),
                                 ("unloaded", ([long_prompt], None))):
        _serve(driver, first, 1 if name == "unloaded" else steps, later)  # warm-up
        start = len(driver.steps)
        runs[name] = _serve(driver, first, 1 if name == "unloaded" else steps, later)
        if name == "arriving":  # its steps that carried the long prompt's chunks beside the decodes
            carried = [r for r in driver.steps[start:] if r.phase == "prefill" and r.decode_rows > 0]
    times, sent = runs["alone"]
    alone = [b - a for i in range(bs) for a, b in zip(times[i][1:], times[i][2:])]
    times, sent = runs["arriving"]
    at, first_token = sent[bs], times[bs][0]
    busy = [b - a for i in range(bs) for a, b in zip(times[i], times[i][1:]) if b > at and a < first_token]
    unloaded_times, unloaded_sent = runs["unloaded"]
    return Arriving(alone, busy, unloaded_times[0][0] - unloaded_sent[0], first_token - at, carried)


def by_depth(steps: List[StepRecord], cost: StepCost | None, long_len: int, parts: int = 4) -> List[Dict[str, Any]]:
    """The steps that carried the long prompt's chunks, by the depth they reached (quarters of the prompt): how many,
    their chunks' tokens and their periods (median), against the cost model's prediction where there is one."""
    out = []
    for q in range(parts):
        lo, hi = q * long_len // parts, (q + 1) * long_len // parts
        part = [r for r in steps if lo < r.deepest <= hi]
        if not part:
            continue
        row = {"depth": f"{lo}-{hi}", "steps": len(part),
               "chunk tokens": statistics.median(r.num_tokens - r.decode_rows for r in part),
               "step ms": round(1e3 * statistics.median(r.seconds for r in part), 2)}
        if cost is not None:
            row["predicted ms"] = round(1e3 * statistics.median(
                cost(r.num_tokens, r.batch_size, r.pairs, r.deepest) for r in part), 2)
        out.append(row)
    return out


def bench_long(model: str, device: str, dtype: str, spec: BenchSpec, limits: Limits, row: Row) -> List[Dict]:
    """The rows: ttft_long at each long length; itl (the running requests alone) and itl_arriving (while the long
    prompt arrives: p50 in median_s, p99 in p99_s) with their p99; ttft_arriving and ttft_alone, that prompt's time to
    first token beside them and alone."""
    engine = long_engine(model, device, dtype, spec)
    rows: List[Dict[str, Any]] = []
    try:
        cost, vocab = model_cost(engine), engine.config.model_config.vocab_size
        driver = Driver(engine, max_prefill_tokens=spec.long_budget)
        for n in tqdm(spec.long_prompts, desc=f"{model} long prompts: time to first token"):
            secs = engine_ttft(driver, n, vocab, spec.repeats)
            rows.append(row(model, "engine", "ttft_long", 1, n, secs, n, cost, limits, (n, 0, n * (n + 1) // 2)))
        if spec.itl:
            rows += arriving_rows(model, arriving(driver, *spec.itl, vocab), *spec.itl)
    finally:
        engine.shutdown()
    return rows


def arriving_rows(model: str, run: Arriving, bs: int, ctx: int, long_len: int, runner: str = "engine") -> List[Dict]:
    rows = []
    for workload, gaps, length in (("itl", run.alone, ctx), ("itl_arriving", run.arriving, long_len)):
        rows.append({"model": model, "runner": runner, "workload": workload, "batch_size": bs,
                     "length": length, "median_s": statistics.median(gaps), "p10_s": percentile(gaps, 10),
                     "p90_s": percentile(gaps, 90), "p99_s": percentile(gaps, 99), "samples": len(gaps),
                     "tokens_per_s": bs / statistics.median(gaps)})
    for workload, secs in (("ttft_arriving", run.ttft_arriving), ("ttft_alone", run.ttft_alone)):
        rows.append({"model": model, "runner": runner, "workload": workload, "batch_size": 1, "length": long_len,
                     "median_s": secs, "samples": 1, "tokens_per_s": long_len / secs})
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
    out += arrival_targets(mine, model)
    return out


def arrival_targets(mine: Dict[tuple, Dict[str, Any]], model: str) -> List[Dict[str, Any]]:
    """The arrival's two targets from its rows (workload, length) -> row."""
    out = []
    alone = next((r for (w, _), r in mine.items() if w == "itl"), None)
    busy = next((r for (w, _), r in mine.items() if w == "itl_arriving"), None)
    if alone and busy and not math.isnan(busy["p99_s"]):
        ratio = busy["p99_s"] / alone["median_s"]
        out.append({"model": model, "target": f"p99 inter-token latency of {busy['batch_size']} running requests "
                    f"while a {busy['length']}-token prompt arrives <= {ITL_RATIO:.0f}x their step without it",
                    "reached": f"{ratio:.1f}x (p50 {busy['median_s'] * 1e3:.2f} ms, p99 {busy['p99_s'] * 1e3:.2f} "
                               f"ms; alone p50 {alone['median_s'] * 1e3:.2f} ms, p99 {alone['p99_s'] * 1e3:.2f} ms)",
                    "met": ratio <= ITL_RATIO})
    loaded = next((r for (w, _), r in mine.items() if w == "ttft_arriving"), None)
    unloaded = next((r for (w, _), r in mine.items() if w == "ttft_alone"), None)
    if loaded and unloaded:
        ratio = loaded["median_s"] / unloaded["median_s"]
        out.append({"model": model, "target": f"that prompt's time to first token <= {TTFT_RATIO:g}x its own alone",
                    "reached": f"{ratio:.2f}x ({loaded['median_s'] * 1e3:.1f} ms against "
                               f"{unloaded['median_s'] * 1e3:.1f} ms)", "met": ratio <= TTFT_RATIO})
    return out


def main(argv: List[str] | None = None) -> int:
    """python -m harness.bench.long_context: the arrival's targets under the driver's default budget and under each
    --stall over a cost model measured first (harness.bench.step_cost); writes long-prompt.md and .json under
    <reports>/bench/<device>/<model>/."""
    import argparse
    import dataclasses
    import json

    from harness.bench.step_cost import measure
    from harness.bench.workloads import SPECS
    from harness.report import markdown_table, provenance, provenance_markdown, report_root, text_table, \
        write_json, written_to
    from harness.step_budget import StepBudget

    p = argparse.ArgumentParser(prog="python -m harness.bench.long_context", description=main.__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default=None, help="default: qwen3-0.6b on cuda, smollm2-135m on cpu")
    p.add_argument("--stall", type=float, action="append", default=[], help="a stall budget to measure, repeatable")
    p.add_argument("--running", type=int, help="running requests (default: the bench spec's)")
    p.add_argument("--ctx", type=int, help="their prompts' tokens")
    p.add_argument("--long", type=int, help="the arriving prompt's tokens")
    p.add_argument("--budget", type=int, help="the prefill budget, the prompt's chunks alone (default: the spec's)")
    p.add_argument("--update-reports", action="store_true")
    args = p.parse_args(argv)
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    model = args.model or ("qwen3-0.6b" if device == "cuda" else "smollm2-135m")
    spec = SPECS[device]
    bs, ctx, long_len = (args.running or spec.itl[0], args.ctx or spec.itl[1], args.long or spec.itl[2])
    spec = dataclasses.replace(spec, itl=(bs, ctx, long_len), long_prompts=(),
                               long_budget=args.budget or spec.long_budget)
    dtype = "bfloat16" if device == "cuda" else "float32"
    engine = long_engine(model, args.device, dtype, spec)
    runs: List[Dict[str, Any]] = []
    try:
        vocab = engine.config.model_config.vocab_size
        budgets = [("tokens", Driver(engine, max_prefill_tokens=spec.long_budget).budget, None)]
        if args.stall:
            fit = measure(Driver(engine, max_prefill_tokens=spec.long_budget), long_len, bs)
            budgets += [(f"stall {x:g}", StepBudget(fit.cost, stall=x), fit) for x in args.stall]
        for name, budget, fit in budgets:
            driver = Driver(engine, max_prefill_tokens=spec.long_budget, step_budget=budget)
            run = arriving(driver, bs, ctx, long_len, vocab)
            rows = arriving_rows(model, run, bs, ctx, long_len, name)
            targets = arrival_targets({(r["workload"], r["length"]): r for r in rows}, model)
            runs.append({"budget": name, "step_budget": repr(budget), "cost_fit": fit and dataclasses.asdict(fit),
                         "rows": rows, "targets": targets,
                         "by_depth": by_depth(run.steps, fit and fit.cost, long_len),
                         "steps": [dataclasses.asdict(r) for r in run.steps]})
            print(f"{name}: " + "; ".join(f"{t['reached']} {'met' if t['met'] else 'NOT met'}" for t in targets),
                  flush=True)
    finally:
        engine.shutdown()
    out = report_root(args.update_reports) / "bench" / device / model
    prov = provenance(args.device, model=model, running=bs, ctx=ctx, long=long_len, budget=spec.long_budget)
    write_json(out / "long-prompt.json", {"provenance": prov, "runs": runs})
    table = [{"budget": r["budget"], **{k: t["reached"] for k, t in zip(("itl", "ttft"), r["targets"])},
              "met": all(t["met"] for t in r["targets"])} for r in runs]
    md = (f"# A {long_len}-token prompt arriving beside {bs} running requests: {model}, {device}\n\n"
          f"{__doc__.split(chr(10), 3)[3]}\nThe prefill budget {spec.long_budget} tokens; each budget below is the "
          "driver's step budget while the requests decode (tokens: the default, FLOP-weighted; stall X: a step at most "
          "X times its decodes alone, over the cost model fitted first, its coefficients in long-prompt.json).\n\n"
          f"{markdown_table(table)}\n## The steps that carried its chunks\n\nBy the depth each reached: their "
          "count, their chunks' tokens and their periods (medians), and the fitted cost model's prediction of them "
          "(long-prompt.json has every step).\n\n"
          + "".join(f"{r['budget']}:\n\n{markdown_table(r['by_depth'])}\n" for r in runs if r["by_depth"])
          + f"## Provenance\n{provenance_markdown(prov)}")
    (out / "long-prompt.md").write_text(md)
    print(text_table(table))
    print(written_to(out / "long-prompt.md", args.update_reports))
    print(json.dumps({r["budget"]: [t["met"] for t in r["targets"]] for r in runs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
