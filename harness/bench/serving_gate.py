"""python -m harness bench --serve --against REF: the serving gate, this tree's engine against another revision's on
the same arrival traces, with the A/B bench's statistics (harness.bench.against, ab_stats).

Each side is a runner process over its tree (harness/bench/ab_runner.py: the side's own engine and driver, this
tree's trace replay), so a change to the driver's scheduling is measured as it serves. A run is --rounds rounds, each
a fresh pair of processes (which starts first turning), of --repeats traces (seeds seed.. seed + repeats - 1, the same
in every round) replayed on both sides back to back, the order turning each repeat. Rows, per point: p99 TTFT, p99
TPOT, p99 ITL (ratio reference / new, above 1 the new revision is faster) and, with --goodput, request goodput
(ratio new / reference, above 1 the new revision serves more requests within the SLO; a run's good requests counted
with half a request more on each side, so that a run where none meets the SLO still has a ratio), each the mean over
the rounds of the round's mean log ratio with its t-interval over the rounds (ab_stats.rounds_ratio). With
--fail-if-slower PCT: exit status 1 when a row's interval lies wholly beyond PCT percent worse (ab_stats.slower_beyond).
REF's driver must serve requests as they arrive (Driver.serve); a revision without it is refused in one line.
Writes <reports>/bench/<device>/serve-against.{md,json,png}.
"""

from __future__ import annotations

import argparse
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Dict, List, Sequence

from harness import EXIT_FINDING, EXIT_PASS, UserError, check_device, progress
from harness.bench import ab_report
from harness.bench.ab_stats import rounds_ratio, threshold_ratio
from harness.bench.against import DTYPES, Side, checkout, tree_provenance
from harness.bench.arrivals import INF, Timing
from harness.bench.serving import Point, ServeSpec, longest, parse_spec, spec_json, trace_for
from harness.bench.serving_metrics import metrics
from harness.models import ModelRef
from harness.report import REPO_ROOT, markdown_table, provenance, provenance_markdown, report_root, text_table, \
    write_json, written_to

ROUNDS = 3
LATENCIES = ("p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms")
COLUMNS = ["point", "metric", "ref_median", "new_median", "ratio", "ci_low", "ci_high", "noise_pct", "rounds",
           "repeats", "verdict"]


def _setup(model: ModelRef, device: str, spec: ServeSpec) -> Dict[str, Any]:
    seq = longest(spec, model) + 16
    setup = {"model_path": str(model.folder), "dummy_weights": not model.has_weights, "device": device,
             "dtype": DTYPES[device.split(":")[0]], "max_running_req": spec.slots, "max_seq_len": seq,
             "num_pages": None}
    if device.startswith("cuda"):
        setup["prefill_graph_max_reqs"] = spec.slots + 1  # a mixed step of every running request's decode and a chunk
    return setup


def _start(sides: Sequence[Side], setup: Dict[str, Any], ref: str) -> None:
    for side in sides:
        side.send(setup)
    for side in sides:
        ready = side.receive()
        if not Path(ready["engine_file"]).resolve().is_relative_to(side.tree.resolve()):
            raise RuntimeError(f"{side.name} side imported its engine from {ready['engine_file']}, not from "
                               f"{side.tree}")
        if not ready.get("serves"):
            raise UserError(f"--against {ref}: its driver has no serve() (requests admitted as they arrive), which "
                            "the serving gate replays traces through; compare against a revision that has it")


def _serve(side: Side, trace: Any) -> List[Timing]:
    side.send({"op": "serve", "trace": trace.to_json()})
    return [Timing(**t) for t in side.receive()["timings"]]


def measure(ref: str, ref_tree: Path, model: ModelRef, device: str, spec: ServeSpec, rounds: int,
            points: Sequence[Point]) -> List[Dict[str, Dict[str, List[List[Dict[str, float]]]]]]:
    """Per point, per side, per round, the repeats' metrics."""
    setup, clock = _setup(model, device, spec), progress.Stopwatch()
    trees = [("ref", ref_tree), ("new", REPO_ROOT)]
    out = [{"ref": [], "new": []} for _ in points]
    for r in range(rounds):
        with ExitStack() as stack:
            sides = [Side(name, tree) for name, tree in (trees if r % 2 == 0 else trees[::-1])]
            for side in sides:
                stack.callback(side.close)
            _start(sides, setup, ref)
            warm = trace_for(spec, model, points[0], 0)
            warm.requests = [type(q)(q.prompt, min(q.output_len, 4), 0.0) for q in warm.requests[:4]]
            for side in sides:
                _serve(side, warm)
            for p, point in enumerate(points):
                for name in ("ref", "new"):
                    out[p][name].append([])
                for i in range(spec.repeats):
                    trace = trace_for(spec, model, point, i)
                    k = i % len(sides)
                    for side in sides[k:] + sides[:k]:
                        out[p][side.name][-1].append(metrics(_serve(side, trace), spec.slo_ms))
        progress.line("bench", f"--serve --against {ref} {model.name} round {r + 1}/{rounds}", "done", clock.lap())
    return out


def _goodput(m: Dict[str, float]) -> float:
    return (m["good_requests"] + 0.5) / m["duration_s"]


def rows(model: str, points: Sequence[Point], measured: List[Dict[str, Any]], with_goodput: bool,
         confidence: float = 0.95) -> List[Dict[str, Any]]:
    """A row per point and gated metric: ratio above 1 when the new revision is better."""
    import statistics

    out = []
    keys = [(k, lambda m, k=k: m[k], False) for k in LATENCIES]
    if with_goodput:
        keys.append(("request_goodput", _goodput, True))
    for point, got in zip(points, measured):
        for key, value, higher in keys:
            ref_r = [[value(m) for m in rnd] for rnd in got["ref"]]
            new_r = [[value(m) for m in rnd] for rnd in got["new"]]
            stat = rounds_ratio(new_r, ref_r, confidence) if higher else rounds_ratio(ref_r, new_r, confidence)
            out.append({"name": f"{model} {point.label}: {key}", "model": model, "point": point.label, "metric": key,
                        "ref_median": statistics.median(x for r in ref_r for x in r),
                        "new_median": statistics.median(x for r in new_r for x in r),
                        "ratio": stat.ratio, "ci_low": stat.low, "ci_high": stat.high, "noise_pct": 100 * stat.noise,
                        "rounds": len(ref_r), "repeats": sum(map(len, ref_r)),
                        "verdict": stat.verdict,
                        "ref_samples": ref_r, "new_samples": new_r})
    return out


def write(result: Dict[str, Any], out_dir: Path) -> Path:
    pct = result["fail_if_slower_pct"]
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "serve-against.json", result)
    result = {**result, "xlabel": "ratio with its interval (latency: reference / new; goodput: new / reference; "
                                  "above 1: the new revision is better)"}
    ab_report.plot(result, out_dir / "serve-against.png")
    spec = result["spec"]
    gate_md = "" if pct is None else (
        f"**Gate** (`--fail-if-slower {pct:g}`): a row fails when its whole interval lies below "
        f"{threshold_ratio(pct):.4f}. " + ab_report.gate_text(result["rows"], pct, bullet="- ") + "\n\n")
    md = (f"# Serving: this tree against {result['ref']['named']} on {result['host']['device_name']}\n\n"
          f"{__doc__.split(chr(10), 2)[2]}\n"
          f"This run: {result['rounds']} rounds of {spec['repeats']} traces of {spec['num_prompts']} requests, "
          f"lengths `{spec['lengths']}`, {spec['dataset']} prompts, SLO {spec['slo_ms'] or 'none'}. verdict faster "
          "/ slower: the new revision better / worse beyond the noise.\n\n"
          f"{gate_md}{markdown_table(result['rows'], COLUMNS + (['gate'] if pct is not None else []))}\n"
          "![every row's ratio with its interval](serve-against.png)\n\n"
          f"## Reference: {result['ref']['named']}\n{provenance_markdown(result['ref'])}\n"
          f"## New: this tree\n{provenance_markdown(result['new'])}\n## Host\n{provenance_markdown(result['host'])}")
    (out_dir / "serve-against.md").write_text(md)
    return out_dir / "serve-against.md"


def command(args: argparse.Namespace) -> int:
    from harness.models import resolve_models

    check_device(args.device, flashinfer=args.device.startswith("cuda"))
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    if args.fail_if_slower is not None and not args.fail_if_slower >= 0:
        raise UserError(f"--fail-if-slower {args.fail_if_slower:g} is not a percentage of 0 or more; give the percent "
                        "worse a row may be (e.g. 10)")
    rounds = ROUNDS if args.rounds is None else args.rounds
    if rounds < 2:
        raise UserError(f"--rounds {rounds}: the interval is over the rounds; give --rounds 2 or more")
    if args.stall is not None:
        raise UserError("--stall sets this engine's budget in a serving run; the gate runs each revision's driver as "
                        "it is: leave it out")
    spec = parse_spec(args, device)
    points = list(spec.points) or [Point("all at once", INF, None)]
    pct = args.fail_if_slower
    result_rows: List[Dict[str, Any]] = []
    for model in resolve_models(args, ("smollm2-135m",), weights=False, verb="bench --serve --against"):
        with checkout(args.against) as (ref_tree, prov):
            measured = measure(args.against, ref_tree, model, args.device, spec, rounds, points)
        result_rows += rows(model.name, points, measured, bool(spec.slo_ms))
    ab_report.gate(result_rows, pct)
    result = {"device": args.device, "spec": spec_json(spec), "rounds": rounds, "fail_if_slower_pct": pct,
              "rows": result_rows, "ref": prov, "new": tree_provenance(REPO_ROOT, "this tree", "this checkout"),
              "host": provenance(args.device, dtype=DTYPES[device])}
    out_dir = report_root(args.update_reports) / "bench" / device
    path = write(result, out_dir)
    print(text_table(result_rows, COLUMNS + (["gate"] if pct is not None else [])))
    print(written_to(path, args.update_reports))
    if pct is None:
        return EXIT_PASS
    print(ab_report.gate_text(result_rows, pct))
    return EXIT_FINDING if any(r["gate"] == "FAIL" for r in result_rows) else EXIT_PASS
