"""The report of bench --serve: serve.md (a table per engine, the comparison, provenance), serve.json (every repeat's
metrics) and serve.png (latency percentiles against output throughput, each point with its interval)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List

from harness.report import markdown_table, provenance_markdown, text_table, write_json

# the columns of a point, each the mean over the repeats with its interval
SHOWN = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
         "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "request_goodput")


def _cell(summary: Dict[str, List[float]], key: str) -> str:
    mean, low, high = summary[key]
    if math.isnan(mean):
        return "-"
    return f"{mean:.4g}" if math.isnan(low) else f"{mean:.4g} [{low:.4g}, {high:.4g}]"


def rows(result: Dict[str, Any], engine: str) -> List[Dict[str, Any]]:
    return [{"point": p["label"], **{k: _cell(p["engines"][engine]["summary"], k) for k in SHOWN}}
            for p in result["points"]]


def comparison(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    out = []
    for p in result["points"]:
        row = {"point": p["label"]}
        for key, r in p.get("comparison", {}).items():
            row[key] = f"{r['ratio']:.3g} [{r['low']:.3g}, {r['high']:.3g}]"
        out.append(row)
    return out


def plot(result: Dict[str, Any], path: Path, title: str) -> Path:
    """TTFT, TPOT, ITL and E2EL (median and p99) against output throughput, a line per engine and percentile."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = list(result["points"][0]["engines"])
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    for ax, metric in zip(axes.flat, ("ttft", "tpot", "itl", "e2el")):
        for e, color in zip(engines, ("tab:blue", "tab:orange")):
            pts = sorted((p["engines"][e]["summary"] for p in result["points"]),
                         key=lambda s: s["output_throughput"][0])
            x = [s["output_throughput"][0] for s in pts]
            for stat, style in (("median", "-"), ("p99", "--")):
                key = f"{stat}_{metric}_ms"
                y = [s[key][0] for s in pts]
                err = [[max(0.0, s[key][0] - s[key][1]) if not math.isnan(s[key][1]) else 0.0 for s in pts],
                       [max(0.0, s[key][2] - s[key][0]) if not math.isnan(s[key][2]) else 0.0 for s in pts]]
                ax.errorbar(x, y, yerr=err, fmt="o" + style, color=color, capsize=3, ms=4,
                            label=f"{e} {stat}")
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(result: Dict[str, Any], prov: Dict[str, Any], out: Path, model: str, other: str | None,
          seconds: float) -> str:
    """serve.{md,json,png} into out; returns the terminal's tables."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "serve.json", {"provenance": prov, **result})
    names = list(result["points"][0]["engines"])
    title = f"Serving {model}: " + " against ".join(f"--engine {n}" for n in names)
    plot(result, out / "serve.png", title)
    spec = result["spec"]
    slo = " ".join(f"{k}:{v:g}" for k, v in spec["slo_ms"].items()) or "none given (request_goodput: -)"
    md = [f"# {title} ({prov['device']})\n",
          f"Requests: {spec['num_prompts']} a trace, lengths `{spec['lengths']}`, {spec['dataset']} prompts"
          + (f", replayed from `{spec['trace_file']}`" if spec["trace_file"] else "") +
          f"; arrivals: burstiness {spec['burstiness']:g} (1: Poisson); each point {spec['repeats']} repeats on "
          f"traces of seeds {spec['seed']}.. (the same requests for every engine), the engines in turn, the order "
          f"alternating. Greedy, every request exactly its output length (EOS ignored). Goodput SLO: {slo}. Each "
          "cell: the mean over the repeats [95% t-interval]. Metric names and definitions are vLLM's serving "
          "benchmark's (`vllm bench serve`; docs/bench.md, Serving): TTFT from a request's sending to its first "
          "token, TPOT (E2EL - TTFT) / (tokens - 1), ITL the gaps between a request's successive chunks, E2EL to "
          f"its last token; throughputs over the run's duration. Wall time {seconds:.0f} s.\n"]
    for name in names:
        md += [f"## --engine {name}\n", markdown_table(rows(result, name), ["point", *SHOWN])]
    if other is not None:
        md += ["## This engine against the other\n",
               "Paired over the repeats (the same trace in each pair): p99 latencies as the other's / this "
               "engine's, throughput and goodput as this engine's / the other's: above 1 favours this engine.\n",
               markdown_table(comparison(result))]
    md += ["![latency percentiles against output throughput](serve.png)\n", "## Provenance\n",
           provenance_markdown(prov)]
    (out / "serve.md").write_text("\n".join(md))
    tables = [f"--engine {n}\n" + text_table(rows(result, n), ["point", *SHOWN]) for n in names]
    if other is not None:
        tables.append("ratios (above 1 favours this engine)\n" + text_table(comparison(result)))
    return "\n\n".join(tables)
