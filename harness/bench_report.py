"""Benchmark reports: <reports>/bench/<device>/{bench.csv, bench.json, summary.md, *.png}; <reports> is
build/reports unless the committed reports/ are asked for (harness.report.report_root)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from harness.report import markdown_table, provenance, provenance_markdown, report_root, write_json, written_to

COLUMNS = ["model", "runner", "workload", "batch_size", "length", "median_s", "p10_s", "p90_s", "tokens_per_s",
           "floor_s", "fraction_of_floor", "achieved_GBps", "achieved_TFLOPs"]


def _get(rows: List[Dict[str, Any]], **match: Any) -> Dict[str, Any] | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def targets(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Where each target of the project stands, from this run's rows."""
    rows, out = result["rows"], []
    on_gpu = result["device"].startswith("cuda")
    for model in dict.fromkeys(r["model"] for r in rows):
        eng = _get(rows, model=model, runner="engine", workload="decode", batch_size=1)
        hf = _get(rows, model=model, runner="hf", workload="decode", batch_size=1)
        if eng and hf:
            ratio = hf["median_s"] / eng["median_s"]
            goal = 20.0 if on_gpu else 2.0
            out.append({"model": model, "target": f"decode bs 1{' with CUDA graphs' if on_gpu else ''} >= {goal:g}x HF",
                        "reached": f"{ratio:.2f}x", "met": ratio >= goal})
        if eng and not on_gpu:
            times_floor = eng["median_s"] / eng["floor_s"]
            out.append({"model": model, "target": "decode bs 1 within 1.5x of the bandwidth floor",
                        "reached": f"{times_floor:.2f}x the floor", "met": times_floor <= 1.5})
        off = _get(rows, model=model, runner="engine", workload="offline")
        if off and on_gpu and model == "qwen3-0.6b":
            out.append({"model": model, "target": "offline workload >= 50% of its bandwidth floor",
                        "reached": f"{100 * off['fraction_of_floor']:.0f}%", "met": off["fraction_of_floor"] >= 0.5})
        sub_e = _get(rows, model=model, runner="engine", workload="offline_subset")
        sub_h = _get(rows, model=model, runner="hf", workload="offline_subset")
        if sub_e and sub_h:
            out.append({"model": model, "target": "offline subset: engine / HF throughput (same requests)",
                        "reached": f"{sub_e['tokens_per_s'] / sub_h['tokens_per_s']:.1f}x", "met": "-"})
    return out


def _plots(rows: List[Dict[str, Any]], out: Path) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for workload, x, y, title, logy in (
            ("decode", "batch_size", "tokens_per_s", "decode throughput vs batch size", True),
            ("decode_ctx", "length", "median_s", "decode step latency vs context (batch 1)", True),
            ("prefill", "length", "tokens_per_s", "prefill throughput vs prompt length", True)):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for model in dict.fromkeys(r["model"] for r in rows):
            for runner in dict.fromkeys(r["runner"] for r in rows):
                pts = sorted((r[x], r[y]) for r in rows if r["workload"] == workload and r["model"] == model
                             and r["runner"] == runner)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{model} {runner}")
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(x.replace("_", " "))
        ax.set_ylabel(y.replace("_", " "))
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{workload}.png", dpi=110)
        plt.close(fig)
        made.append(f"{workload}.png")
    return made


def write_bench_report(result: Dict[str, Any], update: bool = False) -> str:
    import pandas as pd

    device = result["device"].split(":")[0]
    out = report_root(update) / "bench" / device
    out.mkdir(parents=True, exist_ok=True)
    rows = result["rows"]
    frame = pd.DataFrame(rows)
    frame.to_csv(out / "bench.csv", index=False)
    prov = provenance(result["device"], dtype=result["dtype"])
    tgt = targets(result)
    write_json(out / "bench.json", dict(result, provenance=prov, targets=tgt))
    plots = _plots(rows, out)
    lim = result["limits"]
    md = (f"# Benchmarks on {prov['device_name']} ({result['dtype']})\n\n"
          f"Measured in this run: bandwidth {lim['bandwidth'] / 1e9:.1f} GB/s (a large device copy, read + write), "
          f"matmul {lim['matmul_flops'] / 1e12:.2f} TFLOP/s ({result['dtype']}). A floor is max(bytes / bandwidth, "
          "FLOPs / matmul rate) for what the forward must move: every weight once (the embedding as the LM head), "
          "the KV it reads and writes. fraction_of_floor = floor / measured (1.0 would be the limit). The engine is "
          "timed through the driver (host preparation, forward, sampling, copy back, synchronized); HF generate on "
          "the same model, dtype and inputs (sdpa, no compile: the static-cache + torch.compile path was not "
          "measured), its decode step as (time for 1 + n tokens - time for 1) / n. Medians; p10/p90 beside them.\n\n"
          f"## Targets\n{markdown_table(tgt)}\n## Every measurement\n"
          f"{markdown_table(rows, [c for c in COLUMNS if c in frame.columns])}\n"
          "offline: the nano-vllm / mini-sglang workload (random.seed(0), input and output lengths randint"
          f"{tuple(result['spec']['offline'][1:])}, {result['spec']['offline'][0]} requests, EOS ignored, tokens "
          f"actually produced counted); offline_subset: its first {result['spec']['hf_offline'][0]} requests with "
          f"outputs capped at {result['spec']['hf_offline'][1]} tokens, run by both the engine and HF.\n\n"
          + "".join(f"![{p}]({p})\n" for p in plots) +
          f"\n## Provenance\n{provenance_markdown(prov)}")
    (out / "summary.md").write_text(md)
    lines = [f"bench on {result['device']}: {lim['bandwidth'] / 1e9:.1f} GB/s, {lim['matmul_flops'] / 1e12:.2f} TFLOP/s"]
    verdict = {True: "met", False: "NOT met", "-": "-"}
    lines += [f"  {t['model']}: {t['target']}: {t['reached']} ({verdict[t['met']]})" for t in tgt]
    lines.append(written_to(out / "summary.md", update))
    return "\n".join(lines)
