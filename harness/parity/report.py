"""Parity reports: <reports>/parity/<model>/<device>-<dtype>.{md,json} and a terminal summary; <reports> is
build/reports unless the committed reports/ are asked for (harness.report.report_root)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Dict, List

from harness.compare import compare_topk
from harness.parity.gate import ParityResult
from harness.parity.gate import __doc__ as rule
from harness.parity.paths import PATHS
from harness.parity.plot import plot_errors
from harness.subjects import OWN, named, report_dir
from harness.report import (markdown_table, provenance, provenance_markdown, text_table, write_json,
                            written_to)

# compare_topk's rule, from its docstring: what a black box's report says of its numbers
_TOP_K_RULE = " ".join(compare_topk.__doc__.split()).split(". ", 1)[1]
COLUMNS = ["path", "prompt", "max_err_prefill", "max_err_decode", "max_kl", "max_tv", "divergence", "passed"]


def _row(p: Any) -> Dict[str, Any]:
    d = asdict(p)
    div = p.divergence
    d["divergence"] = "-" if div is None else (
        f"step {div['step']}: golden {div['golden_token']} vs engine {div['engine_token']}, gap "
        f"{div['golden_logprob_gap'] if div['golden_logprob_gap'] is None else round(div['golden_logprob_gap'], 6)}, "
        f"ranks {div['engine_token_rank_in_golden']}/{div['golden_token_rank_in_engine']}"
        f"{' (near tie)' if div['near_tie'] else ''}")
    d["passed"] = "PASS" if p.passed else f"FAIL: {p.reason}"
    return d


def summary_rows(result: ParityResult) -> List[Dict[str, Any]]:
    """One row per path: the worst over its prompts."""
    rows = []
    for path in dict.fromkeys(p.path for p in result.prompts):
        ps = [p for p in result.prompts if p.path == path]
        rows.append({"path": path, "prompts": len(ps),
                     "max_err_prefill": max(p.max_err_prefill for p in ps),
                     "max_err_decode": max(p.max_err_decode for p in ps),
                     "max_kl": max(p.max_kl for p in ps), "max_tv": max(p.max_tv for p in ps),
                     "divergences": sum(p.divergence is not None for p in ps),
                     **({} if result.router_tie is None else _router_counts(ps)),
                     "passed": f"{sum(p.passed for p in ps)}/{len(ps)}"})
    return rows


def _router_counts(prompts: List[Any]) -> Dict[str, int]:
    """MoE: positions routed at a near tie, and how many of them exceed the tolerance (passed as near ties)."""
    return {"router_near_ties": sum(p.router_near_ties for p in prompts),
            "router_ties_over_tol": sum(p.router_excused for p in prompts)}


DIST_COLUMNS = ["path", "positions", "err_p50", "err_p90", "err_p99", "err_max", "kl_mean", "kl_p99", "limits",
                "passed"]
ROUTER_DIST_COLUMNS = DIST_COLUMNS[:-2] + ["router_near_ties", "left_out"] + DIST_COLUMNS[-2:]


def distribution_rows(result: ParityResult) -> List[Dict[str, Any]]:
    """One row per path: the engine's error distribution, and the half-precision gate's limits on it."""
    rows = []
    for p in result.paths:
        limits = "-" if p.limits is None else ", ".join(f"{k} {v:.3g}" for k, v in p.limits.items())
        router = {} if result.router_tie is None else {"router_near_ties": p.router_near_ties, "left_out": p.left_out}
        rows.append({"path": p.path, "positions": p.positions, **p.stats, **router, "limits": limits,
                     "passed": "PASS" if p.passed else f"FAIL: {p.reason}"})
    return rows


def _router_line(result: ParityResult) -> str:
    if result.router_tie is None:
        return ""
    ties = sum(p.router_near_ties for p in result.paths)
    left = sum(p.left_out for p in result.paths)
    return (f"Router near ties (a MoE layer's k-th and (k+1)-th router logits within {result.router_tie:.3g} x the "
            f"row's largest |logit|, the engine's or the golden's): {ties} positions over every path"
            f"{f', {left} of them left out of the distributions' if left else ''}.\n\n")


def _hf_line(result: ParityResult) -> str:
    s = result.hf_stats
    if not s:
        return _router_line(result)
    where = " away from router near ties" if "near_tie_positions" in s else ""
    return (f"HF's own spread (each statistic the larger of HF against itself, eager vs sdpa and thread counts, and "
            f"HF against float64, on the golden's sequences, {s['positions']} positions{where}): err p50 "
            f"{s['err_p50']:.3g}, p90 {s['err_p90']:.3g}, p99 {s['err_p99']:.3g}, max {s['err_max']:.3g}; KL mean "
            f"{s['kl_mean']:.3g}, p99 {s['kl_p99']:.3g}{_parts(s)}. Near-tie tolerance {result.tie_tol:.3g}.\n\n"
            f"{_router_line(result)}")


def _parts(s: Dict[str, Any] | None) -> str:
    """The two measures HF's own spread is the larger of: its kernels' and its distance to float64."""
    if s and s.get("float64_unmeasured"):
        return f" (HF to float64 not measured: {s['float64_unmeasured']})"
    if not s or "float64_err_max" not in s:
        return ""
    kernels = "refuted by float64" if s.get("kernel_refuted") else f"{s.get('kernel_err_max', float('nan')):.3g}"
    return f" (largest err: HF's kernels {kernels}, HF to float64 {s['float64_err_max']:.3g})"


def _findings(result: ParityResult) -> str:
    """What float64 refutes of HF's own runs on this golden, and the positions parity left unjudged for it."""
    if not result.hf_findings:
        return ""
    skipped = sum(p.hf_off for p in result.prompts)
    tail = (f"\n{skipped} compared positions are not judged: the golden's own row is off there" if skipped else "")
    return "HF's own bugs (not taken into the tolerance):\n" + "\n".join(result.hf_findings) + tail


def _top_k_rule(result: ParityResult) -> str:
    if result.top_k is None:
        return ""
    return (f"## Another engine's top-k\n`--engine {result.engine}` returns its own top-{result.top_k} at each "
            f"position, not HF's top-K: {_TOP_K_RULE}\n\n")


def write_report(result: ParityResult, write_files: bool = True, update: bool = False) -> str:
    """Write the markdown and JSON reports (into the committed reports/ only when `update`); return the terminal
    summary."""
    tp = f" with TP={result.tp}" if result.tp > 1 else ""
    tp += " in batch-invariant mode" if result.batch_invariant else ""
    tp += f" (--engine {named(result.engine, result.engine_info)})" if result.engine != OWN else ""
    head = (f"parity {result.model} on {result.device}{tp} in {result.dtype}: "
            f"{'PASS' if result.passed else 'FAIL'} (tol {result.tol:.3g} = max(4 x HF spread {result.hf_spread:.3g}, "
            f"floor){_parts(result.hf_stats)})")
    summary = text_table(summary_rows(result))
    failing = [_row(p) for p in result.prompts if not p.passed]
    text = f"{result.failure}\n{head}\n{summary}" if result.failure else f"{head}\n{summary}"
    if result.hf_findings:
        text += "\n" + _findings(result)
    if failing:
        text += "\nfailing prompts:\n" + text_table(failing, ["path", "prompt", "passed", "divergence"])
    bad_paths = [f"{p.path}: {p.reason}" for p in result.paths if not p.passed]
    if bad_paths:
        text += "\nfailing error distributions:\n  " + "\n  ".join(bad_paths)
    if (failing or bad_paths) and not result.failure:
        text += f"\nthe engine's result, in the golden's format: {result.obtained}"
    if not write_files:
        return text
    prov = provenance(result.device, model=result.model, dtype=result.dtype, tp=result.tp,
                      **({} if result.engine == OWN else {"engine": result.engine}),
                      **({"engine_provenance": result.engine_info} if result.engine_info else {}))
    name = f"{result.device.split(':')[0]}-{result.dtype}" + (f"-tp{result.tp}" if result.tp > 1 else "") + \
        ("-batch-invariant" if result.batch_invariant else "")
    out = report_dir(result.engine, update) / "parity" / result.model / name
    moe = result.router_tie is not None
    dist_cols = ROUTER_DIST_COLUMNS if moe else DIST_COLUMNS
    prompt_cols = COLUMNS[:-1] + ["router_near_ties", "passed"] if moe else COLUMNS
    first = f"```\n{result.failure}\n```\n\n" if result.failure else ""
    found = f"```\n{_findings(result)}\n```\n\n" if result.hf_findings else ""
    paths = "\n".join(f"- `{p.name}`: {p.description}" for p in PATHS if p.name in {r.path for r in result.prompts})
    md = (f"# Parity: {result.model}, {result.device}{tp}, {result.dtype}\n\n**{'PASS' if result.passed else 'FAIL'}**, "
          f"tolerance {result.tol:.3g} on log-probabilities (HF's own spread {result.hf_spread:.3g}).\n\n"
          f"{first}"
          f"## Rule\n{rule}\n{_top_k_rule(result)}"
          f"## Paths\n{paths}\n\n## Summary\n{markdown_table(summary_rows(result))}\n"
          f"## Error distribution per path\n{_hf_line(result)}"
          f"{found}"
          f"{markdown_table(distribution_rows(result), dist_cols)}\n"
          f"## Every prompt\n{markdown_table([_row(p) for p in result.prompts], prompt_cols)}\n"
          f"## Provenance\n{provenance_markdown(prov)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(md)
    plot_errors(result, out.with_suffix(".png"))
    write_json(out.with_suffix(".json"), {"provenance": prov, "tol": result.tol, "hf_spread": result.hf_spread,
                                          "tie_tol": result.tie_tol, "hf_spread_stats": result.hf_stats,
                                          **({} if result.router_tie is None else {"router_tie": result.router_tie}),
                                          "passed": result.passed, "paths": [asdict(p) for p in result.paths],
                                          "prompts": [asdict(p) for p in result.prompts]})
    return f"{text}\n{written_to(out.with_suffix('.md'), update)}"
