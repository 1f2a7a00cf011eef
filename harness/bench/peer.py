"""python -m harness bench --engine SPEC: this engine and another on the same model, workloads and cores, in one run.

Both subjects are started once (harness.subjects: this engine in this process, vLLM in its worker, a server as it
runs); then for every workload, REPEATS times, each side runs it back to back, the order alternating, so that
whatever the host does meanwhile hits both. A row's ratio is the other engine's time over this engine's (> 1: this
engine is faster), exp of the mean paired log ratio with its t-interval (harness.bench.ab_stats.paired_ratio).

Workloads, on random token ids (no EOS stop; every call its own, so that no prefix cache serves it): the time to the
first token of one prompt of 128, 512 and 2048 tokens (in each repeat the median of TTFT_RUNS), and the period of
a decode step at batch 1, 8 and 32 over a context of about CTX tokens: (the time of 1 + STEPS tokens - the time of 1
token) / STEPS, the two timed in the same repeat.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List

from harness import EXIT_PASS, progress, report, subjects
from harness.bench.ab_stats import paired_ratio
from harness.bench.workloads import decode_prompt_len, random_ids
from harness.models import ModelRef, resolve_models
from harness.subjects.base import Subject

REPEATS, WARMUP = 5, 1
# STEPS: enough decode steps that they, not the prefill's noise, make the difference of the two times
TTFT_RUNS = 3  # a repeat's time to first token: the median of this many prefills (one alone is noisy)
TTFT_LENGTHS, DECODE_BATCHES, CTX, STEPS = (128, 512, 2048), (1, 8, 32), 128, 48


@dataclass
class PeerRow:
    workload: str
    engine_s: float  # this engine's median
    peer_s: float  # the other's median
    ratio: float  # peer / engine, from the paired log ratios
    low: float
    high: float
    verdict: str  # this engine faster, slower, or no difference at this noise
    repeats: int


def _workloads(vocab: int) -> Dict[str, Callable[[Subject], float]]:
    """name -> how to time it on a subject. Every timed call gets prompts of its own (random ids of the same lengths):
    a server that caches prefixes (vLLM's does by default) would otherwise answer a repeated prompt from its cache."""
    calls = itertools.count(1)

    def fresh(n: int, bs: int) -> List[List[int]]:
        base = 1_000_003 * next(calls)
        return [random_ids(n, vocab, seed=base + i) for i in range(bs)]

    out: Dict[str, Callable[[Subject], float]] = {}
    for n in TTFT_LENGTHS:
        out[f"ttft {n} tokens"] = lambda s, n=n: statistics.median(s.timed(fresh(n, 1), 1) for _ in range(TTFT_RUNS))
    for bs in DECODE_BATCHES:
        out[f"decode step, batch {bs}, ctx {CTX}"] = lambda s, bs=bs: _decode_step(
            s, lambda: fresh(decode_prompt_len(CTX, STEPS), bs))
    return out


class TooNoisy(Exception):
    """A row whose measurement the host's noise swamps: said in the row, not a crash of the run."""


def _decode_step(subject: Subject, prompts: Callable[[], List[List[int]]]) -> float:
    step = (subject.timed(prompts(), 1 + STEPS) - subject.timed(prompts(), 1)) / STEPS
    if step <= 0:
        raise TooNoisy(f"{STEPS} decode steps took no measurable time beyond a prefill")
    return step


def _row(name: str, measure: Callable[[Subject], float], ours: Subject, peer: Subject, repeats: int) -> PeerRow:
    """Both sides back to back, the order turning each repeat; a row the host is too noisy for says so."""
    try:
        for _ in range(WARMUP):
            measure(ours)
            measure(peer)
        a, b = [], []
        for r in range(repeats):
            for side in ((ours, a), (peer, b))[::1 if r % 2 == 0 else -1]:
                side[1].append(measure(side[0]))
    except TooNoisy as e:
        nan = float("nan")
        return PeerRow(name, nan, nan, nan, nan, nan, f"not measured: {e}; the host is too noisy for it", repeats)
    pr = paired_ratio(b, a)  # ref = the other engine, new = this one: > 1 when this one takes less time
    verdict = {"faster": "this engine faster", "slower": "this engine slower"}.get(pr.verdict, pr.verdict)
    return PeerRow(name, statistics.median(a), statistics.median(b), pr.ratio, pr.low, pr.high, verdict, repeats)


def run_peer_bench(spec: str, model: ModelRef, repeats: int = REPEATS) -> tuple[List[PeerRow], Dict]:
    """The rows, and the other engine's provenance."""
    ours: Subject = subjects.open_subject(subjects.OWN, model, own_process=True)
    try:
        peer = subjects.open_subject(spec, model, own_process=True)
    except BaseException:
        ours.close()
        raise
    rows, info = [], peer.provenance()
    try:
        for name, measure in _workloads(model.config.vocab_size).items():
            clock = progress.Stopwatch()
            rows.append(_row(name, measure, ours, peer, repeats))
            ratio = rows[-1].ratio
            progress.line("bench", f"{model.name} {name}", "not measured" if math.isnan(ratio) else f"{ratio:.2f}x",
                          clock.lap())
    finally:
        peer.close()
        ours.close()
    return rows, info


COLUMNS = ["workload", "engine_s", "peer_s", "ratio", "low", "high", "verdict", "repeats"]


def command(args: argparse.Namespace) -> int:
    subjects.check(args.engine)
    models = resolve_models(args, ("smollm2-135m", "gemma3-270m"), verb="bench --engine")
    for model in models:
        start = time.perf_counter()
        rows, info = run_peer_bench(args.engine, model, args.repeats or REPEATS)
        out = subjects.report_dir(args.engine, args.update_reports) / "bench" / args.device / model.name
        prov = report.provenance(args.device, model=model.name, engine=args.engine, engine_provenance=info)
        table = [asdict(r) for r in rows]
        md = (f"# This engine against `--engine {subjects.named(args.engine, info)}`: {model.name}, {args.device}\n\n"
              f"{__doc__.split(chr(10), 1)[1]}\n`engine_s` / `peer_s`: medians in seconds; `ratio`: the other's "
              f"time / this engine's, 95% interval [low, high]. Wall time {time.perf_counter() - start:.0f} s.\n\n"
              f"{report.markdown_table(table, COLUMNS)}\n## Provenance\n{report.provenance_markdown(prov)}")
        out.mkdir(parents=True, exist_ok=True)
        (out / "peer.md").write_text(md)
        report.write_json(out / "peer.json", {"provenance": prov, "rows": table})
        print(report.text_table(table, COLUMNS))
        print(report.written_to(out / "peer.md", args.update_reports))
    return EXIT_PASS
