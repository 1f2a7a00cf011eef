"""python -m harness bench --serve: the engine serving requests that arrive over time, measured as `vllm bench serve`
measures a server (harness.bench.serving_metrics: TTFT, TPOT, ITL, E2EL, throughput, goodput), for any --engine.

A run replays arrival traces (harness.bench.arrivals) against each engine: this one through the driver admitting
requests as they arrive (a worker process of its own, the timings taken there), and with --engine another on the
same traces: vLLM's async engine in its worker, an OpenAI-compatible server over streamed completions, or a
python:MODULE:CLASS engine through the driver. Points: each --rate (requests a second, Poisson, or gamma with
--burstiness), each --concurrency (requests in flight, each sent when one finishes), or by default a sweep up to
saturation: all requests at once first (the saturation point, whose request throughput is the capacity), then rates
at FRACTIONS of the larger engine's capacity. Each point is replayed --repeats times on traces of successive seeds
(the same requests for every engine and rate), the engines in turn, the order alternating; each figure is the mean
over the repeats with its 95% t-interval, and with two engines each point's ratios are paired over the repeats
(harness.bench.ab_stats.paired_ratio). Writes serve.md, serve.json and serve.png.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

from harness import EXIT_FINDING, EXIT_PASS, UserError, check_device, progress, report, subjects
from harness.bench.ab_stats import mean_interval, paired_ratio
from harness.bench.arrivals import INF, Lengths, Trace, make_trace, random_prompts, read_trace
from harness.bench.serving_metrics import metrics, parse_goodput
from harness.models import ModelRef
from harness.subjects.base import Subject

FRACTIONS = (0.25, 0.5, 0.75, 0.9)
TEXT = report.REPO_ROOT / "golden" / "prompts-long-context.jsonl"  # the committed real text (King James Bible)


@dataclass(frozen=True)
class Defaults:
    lengths: str
    num_prompts: int
    slots: int  # requests an engine runs at once


DEFAULTS = {"cpu": Defaults("uniform:128:32:0.5,long:1024:0.1", 32, 64),
            "cuda": Defaults("uniform:1024:128:0.5,long:16384:0.05", 256, 256)}
# (metric, lower is better) set beside the other engine's
COMPARED = (("p99_ttft_ms", True), ("p99_tpot_ms", True), ("p99_itl_ms", True), ("output_throughput", False),
            ("request_goodput", False))


@dataclass(frozen=True)
class Point:
    label: str
    rate: float
    concurrency: int | None


@dataclass(frozen=True)
class ServeSpec:
    lengths: Lengths
    dataset: str  # random | text
    num_prompts: int
    points: Tuple[Point, ...]  # empty: the sweep up to saturation
    burstiness: float
    repeats: int
    seed: int
    slo_ms: Dict[str, float]
    trace_file: Path | None
    stall: float | None  # this engine's step budget: a stall over its measured cost (None: the driver's default)
    slots: int


# ------------------------------------------------------------------------------------------------ traces
def text_prompts(tokenizer: Any) -> Callable[[List[int], random.Random], List[List[int]]]:
    """Excerpts of the committed real text (golden/prompts-long-context.jsonl) at seeded offsets, wrapping around
    for prompts longer than it."""
    import json

    ids: List[int] = []
    for line in TEXT.read_text().splitlines():
        ids += tokenizer(json.loads(line)["prompt"], add_special_tokens=False)["input_ids"]

    def excerpts(lengths: List[int], rng: random.Random) -> List[List[int]]:
        out = []
        for n in lengths:
            start = rng.randrange(len(ids))
            out.append([ids[(start + i) % len(ids)] for i in range(n)])
        return out

    return excerpts


def trace_for(spec: ServeSpec, model: ModelRef, point: Point, repeat: int) -> Trace:
    """The trace of a point's repeat: the file's, or spec's requests of seed spec.seed + repeat at the point's pace."""
    if spec.trace_file is not None:
        trace = _read(spec.trace_file, model)
        trace.concurrency = point.concurrency
        return trace
    prompts = text_prompts(_tokenizer(model)) if spec.dataset == "text" else random_prompts(model.config.vocab_size)
    trace = make_trace(prompts, spec.lengths, spec.num_prompts, point.rate, spec.burstiness, point.concurrency,
                       spec.seed + repeat)
    trace.about.update(lengths=_spec_text(spec.lengths), dataset=spec.dataset)
    return trace


_TOKENIZERS: Dict[str, Any] = {}


def _tokenizer(model: ModelRef) -> Any:
    if model.name not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS[model.name] = AutoTokenizer.from_pretrained(model.folder)
    return _TOKENIZERS[model.name]


def _read(path: Path, model: ModelRef) -> Trace:
    tok = _tokenizer(model)
    return read_trace(path, lambda text: tok(text, add_special_tokens=False)["input_ids"], model.config.vocab_size)


def _spec_text(lengths: Lengths) -> str:
    out = f"{lengths.dist}:{lengths.input_len}:{lengths.output_len}:{lengths.spread:g}"
    return out + (f",long:{lengths.long_len}:{lengths.long_share:g}" if lengths.long_share else "")


def longest(spec: ServeSpec, model: ModelRef) -> int:
    """The most tokens (prompt and output) a request of the run holds."""
    if spec.trace_file is None:
        return spec.lengths.longest()
    return max(len(r.prompt) + r.output_len for r in _read(spec.trace_file, model).requests)


# ------------------------------------------------------------------------------------------------ the run
def open_engines(spec: ServeSpec, model: ModelRef, other: str | None, device: str) -> List[Tuple[str, Subject]]:
    """(name, subject) of this engine and, if given, the other: both sized for the run's longest request."""
    serving = {"max_seq_len": longest(spec, model) + 16, "slots": spec.slots, "stall": spec.stall,
               "cost_depth": min(longest(spec, model), 4096 if device == "cpu" else 32768)}
    out = [(subjects.OWN, subjects.open_subject(subjects.OWN, model, own_process=True, serving=serving, device=device))]
    if other is not None:
        try:
            out.append((other, subjects.open_subject(other, model, own_process=True, serving=serving, device=device)))
        except BaseException:
            out[0][1].close()
            raise
    return out


def _warm_up(engines: Sequence[Tuple[str, Subject]], trace: Trace) -> None:
    """A few requests at once through each engine: its first forwards (allocations, kernels' first calls) are not
    the run's."""
    reqs = trace.requests[: min(4, len(trace.requests))]
    warm = Trace([type(r)(r.prompt, min(r.output_len, 4), 0.0) for r in reqs])
    for _, subject in engines:
        subject.serve(warm)


def _measure(engines: Sequence[Tuple[str, Subject]], spec: ServeSpec, model: ModelRef, point: Point,
             clock: progress.Stopwatch) -> Dict[str, List[Dict[str, float]]]:
    """Each engine's metrics on each repeat of the point, the engines in turn, the order alternating."""
    out: Dict[str, List[Dict[str, float]]] = {name: [] for name, _ in engines}
    for r in range(spec.repeats):
        trace = trace_for(spec, model, point, r)
        order = engines if r % 2 == 0 else list(reversed(engines))
        for name, subject in order:
            m = metrics(subject.serve(trace), spec.slo_ms)
            out[name].append(m)
            progress.line("bench", f"--serve {model.name} {name} {point.label} repeat {r + 1}/{spec.repeats}",
                          f"{m['request_throughput']:.3g} req/s", clock.lap())
    return out


def _summary(repeats: List[Dict[str, float]]) -> Dict[str, List[float]]:
    return {k: list(mean_interval([m[k] for m in repeats])) for k in repeats[0] if isinstance(repeats[0][k], float)}


def _compare(ours: List[Dict[str, float]], theirs: List[Dict[str, float]]) -> Dict[str, Any]:
    """Per compared metric, the other engine against this one paired over the repeats, oriented so that above 1
    favours this engine (the other's latency / this one's, this one's throughput / the other's)."""
    out: Dict[str, Any] = {}
    for key, lower in COMPARED:
        a, b = [m[key] for m in ours], [m[key] for m in theirs]
        if len(a) < 2 or any(not x > 0 for x in a + b):  # no goodput asked for, or a zero: no ratio
            continue
        pr = paired_ratio(b, a) if lower else paired_ratio(a, b)
        out[key] = {"ratio": pr.ratio, "low": pr.low, "high": pr.high}
    return out


def run_serving(spec: ServeSpec, model: ModelRef, other: str | None, device: str) -> Dict[str, Any]:
    clock = progress.Stopwatch()
    engines = open_engines(spec, model, other, device)
    points: List[Dict[str, Any]] = []
    try:
        infos = {name: s.provenance() for name, s in engines}
        todo = list(spec.points) or [Point("all at once", INF, None)]
        _warm_up(engines, trace_for(spec, model, todo[0], 0))
        while todo:
            point = todo.pop(0)
            measured = _measure(engines, spec, model, point, clock)
            entry = {**asdict(point), "rate": _rate_text(point.rate),
                     "engines": {n: {"repeats": ms, "summary": _summary(ms)} for n, ms in measured.items()}}
            if other is not None:
                entry["comparison"] = _compare(measured[subjects.OWN], measured[other])
            points.append(entry)
            if not spec.points and len(points) == 1:  # the sweep: rates at fractions of the capacity
                capacity = max(statistics.fmean(m["request_throughput"] for m in ms) for ms in measured.values())
                todo = [Point(f"{f:.0%} of {capacity:.3g} req/s", f * capacity, None) for f in FRACTIONS]
    finally:
        for _, s in engines:
            s.close()
    return {"spec": spec_json(spec), "points": points, "engines": infos,
            "seconds": round(clock.total(), 1)}


def _rate_text(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def spec_json(spec: ServeSpec) -> Dict[str, Any]:
    out = asdict(spec)
    out.update(lengths=_spec_text(spec.lengths), points=[p.label for p in spec.points] or "sweep",
               trace_file=spec.trace_file.name if spec.trace_file else None)
    return out


# ------------------------------------------------------------------------------------------------ the command
def parse_spec(args: argparse.Namespace, device: str) -> ServeSpec:
    """The run's spec from the command line; what cannot run is a UserError."""
    d = DEFAULTS["cuda" if device.startswith("cuda") else "cpu"]
    try:
        lengths = Lengths.parse(args.lengths or d.lengths)
        slo = parse_goodput(args.goodput or [])
    except ValueError as e:
        raise UserError(f"{e}") from None
    rates = [_parse_rate(r) for r in (args.rate or [])]
    conc = list(args.concurrency or [])
    if any(c < 1 for c in conc):
        raise UserError(f"--concurrency {min(conc)}: give 1 or more requests in flight")
    if len(rates) > 1 and conc:
        raise UserError("--rate and --concurrency together take one rate (each concurrency at that rate)")
    points = ([Point(f"concurrency {c}" + (f" at {rates[0]:g} req/s" if rates else ""), rates[0] if rates else INF, c)
               for c in conc] or [Point(f"{r:g} req/s" if not math.isinf(r) else "all at once", r, None)
                                  for r in rates])
    if args.trace is not None:
        if not args.trace.is_file():
            raise UserError(f"--trace {args.trace}: no such file; give a trace file (docs/bench.md, Serving)")
        if rates:
            raise UserError("--trace replays the file's arrival times; leave --rate out (--concurrency caps it)")
        points = points or [Point(f"trace {args.trace.name}", INF, None)]
    repeats = args.repeats if args.repeats is not None else 3
    if repeats < 1 or (args.num_prompts is not None and args.num_prompts < 1) or not args.burstiness > 0:
        raise UserError("--repeats and --num-prompts must be 1 or more, --burstiness above 0")
    if args.stall is not None and not args.stall > 1:
        raise UserError(f"--stall {args.stall}: a step may cost that many times its decodes alone; give more than 1")
    return ServeSpec(lengths, args.dataset, args.num_prompts or d.num_prompts, tuple(points), args.burstiness,
                     repeats, args.seed, slo, args.trace, args.stall,
                     max(conc + [min(args.num_prompts or d.num_prompts, d.slots)]))


def _parse_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise UserError(f"--rate {text}: give requests a second (a number, or inf: all at once)") from None
    if not rate > 0:
        raise UserError(f"--rate {text}: give a rate above 0 (inf: all at once)")
    return rate


def command(args: argparse.Namespace) -> int:
    from harness.bench.serving_report import write
    from harness.models import resolve_models

    check_device(args.device, flashinfer=args.device.startswith("cuda"))  # this engine's numbers there are FlashInfer's
    other = None if args.engine == subjects.OWN else args.engine
    if other is not None:
        subjects.check(other)
    spec = parse_spec(args, args.device)
    if args.trace is not None:
        for model in resolve_models(args, ("smollm2-135m",), weights=False, verb="bench --serve"):
            try:
                _read(args.trace, model)
            except (ValueError, KeyError, TypeError) as e:
                raise UserError(f"--trace {args.trace}: {e}") from None
    failed = False
    # random token ids need no tokenizer (a dummy-weight shape serves); text, a trace and a peer's server do
    text = spec.dataset == "text" or args.trace is not None or other is not None
    for model in resolve_models(args, ("smollm2-135m",), weights=False, tokenizer=text, verb="bench --serve"):
        start = time.perf_counter()
        result = run_serving(spec, model, other, args.device)
        prov = report.provenance(args.device, model=model.name, engines=result.pop("engines"))
        out = subjects.report_dir(args.engine, args.update_reports) / "bench" / args.device / model.name
        print(write(result, prov, out, model.name, other, time.perf_counter() - start))
        print(report.written_to(out / "serve.md", args.update_reports))
        bad = [(p["label"], n) for p in result["points"] for n, e in p["engines"].items()
               if any(m["failed"] for m in e["repeats"])]
        for label, name in bad:
            print(f"FAIL: {name} failed requests at {label} (serve.json has the counts)")
        failed = failed or bool(bad)
    return EXIT_FINDING if failed else EXIT_PASS
