"""Benchmark reports, one folder per model whatever the run's models: <reports>/bench/<device>/<model>/{bench.csv,
bench.json, summary.md, *.png}, so a model's latest figures have one place; <reports> is build/reports unless the
committed reports/ are asked for (harness.report.report_root)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from harness.bench.anchors import anchors_section
from harness.bench.gemm import TARGET_FRACTION, gemm_section
from harness.bench.long_context import long_context_targets
from harness.bench.profile import by_category
from harness.report import markdown_table, provenance, provenance_markdown, report_root, write_json, written_to

COLUMNS = ["model", "runner", "workload", "batch_size", "length", "median_s", "p10_s", "p90_s", "samples",
           "tokens_per_s", "floor_s", "fraction_of_floor", "achieved_GBps", "achieved_TFLOPs", "warmup_s"]


def _get(rows: List[Dict[str, Any]], **match: Any) -> Dict[str, Any] | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def _target(model: str, target: str, reached: str, met: Any) -> Dict[str, Any]:
    return {"model": model, "target": target, "reached": reached, "met": met}


# decode-step figures published for a model's shape on Hopper (batch size not stated; not measured here)
PUBLISHED = {"qwen3-30b-a3b": "Mirage's persistent kernel 4.9 ms, SGLang 5.0 ms, vLLM 6.5 ms (batch size not stated)"}


def targets(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Where each target of the project stands, from this run's rows and profiles."""
    rows, profiles, out = result["rows"], result.get("profiles", []), []
    on_gpu = result["device"].startswith("cuda")
    for model in dict.fromkeys(r["model"] for r in rows):
        eng = _get(rows, model=model, runner="engine", workload="decode", batch_size=1)
        hf = _get(rows, model=model, runner="hf", workload="decode", batch_size=1)
        static = _get(rows, model=model, runner="hf-static", workload="decode", batch_size=1)
        if eng and not on_gpu and hf:
            ratio = hf["median_s"] / eng["median_s"]
            out.append(_target(model, "decode bs 1 >= 2x HF", f"{ratio:.2f}x", ratio >= 2.0))
            times_floor = eng["median_s"] / eng["floor_s"]
            out.append(_target(model, "decode bs 1 within 1.5x of the bandwidth floor",
                               f"{times_floor:.2f}x the floor", times_floor <= 1.5))
        out += _first_token_targets(rows, model, on_gpu)
        out += long_context_targets(rows, model)
        if not on_gpu:
            continue
        gemms = [g for g in result.get("gemms", []) if g["model"] == model]
        if gemms:
            worst = min(gemms, key=lambda g: g["fraction_of_bandwidth"])
            out.append(_target(model, f"every GEMM at M = 1 >= {100 * TARGET_FRACTION:.0f}% of the bandwidth",
                               f"worst: {worst['gemm']} {100 * worst['fraction_of_bandwidth']:.0f}%",
                               worst["fraction_of_bandwidth"] >= TARGET_FRACTION))
        prof = {p["batch_size"]: p for p in profiles if p["model"] == model and p["runner"] == "engine"}
        if 1 in prof and "kernels_per_layer" in prof[1]:
            per_layer = prof[1]["kernels_per_layer"]
            out.append(_target(model, "<= 15 kernels per layer in a decode step", f"{per_layer:.1f}",
                               per_layer <= 15))
            out.append(_target(model, "graph replay <= 1.1 ms at bs 1", f"{prof[1]['replay_s'] * 1e3:.2f} ms",
                               prof[1]["replay_s"] <= 1.1e-3))
        if 256 in prof and "replay_s" in prof[256]:
            out.append(_target(model, "graph replay <= 5.0 ms at bs 256", f"{prof[256]['replay_s'] * 1e3:.2f} ms",
                               prof[256]["replay_s"] <= 5.0e-3))
        if eng:
            out.append(_target(model, "decode bs 1 through the driver <= 1.5 ms",
                               f"{eng['median_s'] * 1e3:.2f} ms", eng["median_s"] <= 1.5e-3))
        if eng and static:
            ratio = static["median_s"] / eng["median_s"]
            out.append(_target(model, "decode bs 1 >= 2.3x HF static cache + compile", f"{ratio:.2f}x "
                               f"({static['median_s'] * 1e3:.2f} ms)", ratio >= 2.3))
        if eng and hf:
            out.append(_target(model, "decode bs 1: engine / HF eager", f"{hf['median_s'] / eng['median_s']:.1f}x",
                               "-"))
        big = _get(rows, model=model, runner="engine", workload="decode", batch_size=256)
        if big:
            out.append(_target(model, "decode bs 256 <= 5.0 ms per step", f"{big['median_s'] * 1e3:.2f} ms",
                               big["median_s"] <= 5.0e-3))
        off = _get(rows, model=model, runner="engine", workload="offline")
        if off:
            out.append(_target(model, "offline workload >= 23,000 tok/s and >= 62% of its floor",
                               f"{off['tokens_per_s']:,.0f} tok/s, {100 * off['fraction_of_floor']:.0f}%",
                               off["tokens_per_s"] >= 23000 and off["fraction_of_floor"] >= 0.62))
        alternating = _get(rows, model=model, runner="engine", workload="offline_alternating")
        if off and alternating:
            out.append(_target(model, "offline workload: mixed steps (new requests beside the running ones' decodes) "
                               "against alternating steps", f"{off['tokens_per_s']:,.0f} against "
                               f"{alternating['tokens_per_s']:,.0f} tok/s", "-"))
        greedy = _get(rows, model=model, runner="engine", workload="offline_greedy")
        if off and greedy:
            out.append(_target(model, "offline workload: what sampling at temperature 0.6 costs (the run minus the "
                               "same requests greedy)", f"{off['median_s'] - greedy['median_s']:.2f} s of "
                               f"{off['median_s']:.2f} s", "-"))
        if eng and model in PUBLISHED:
            steps = [_get(rows, model=model, runner="engine", workload="decode", batch_size=b) for b in (1, 64, 256)]
            out.append(_target(model, f"decode step beside published Hopper figures for this shape: {PUBLISHED[model]}",
                               ", ".join(f"bs {r['batch_size']} {r['median_s'] * 1e3:.2f} ms" for r in steps if r),
                               "-"))
        sub_e = _get(rows, model=model, runner="engine", workload="offline_subset")
        sub_h = _get(rows, model=model, runner="hf", workload="offline_subset")
        if sub_e and sub_h:
            out.append(_target(model, "offline subset: engine / HF eager throughput (same requests)",
                               f"{sub_e['tokens_per_s'] / sub_h['tokens_per_s']:.1f}x", "-"))
    return out


PREFILL_TARGETS = {128: 2.0e-3, 512: 2.5e-3}  # CUDA: seconds for a prefill of this many tokens
PREFILL_COMPUTE = (4096, 0.7)  # CUDA: this long a prefill reaches this fraction of its compute floor


def _first_token_targets(rows: List[Dict[str, Any]], model: str, on_gpu: bool) -> List[Dict[str, Any]]:
    """The prefill targets (CUDA) with the eager forward's time beside, and the time to first token (every device)."""
    out = []
    pre = {r["length"]: r for r in rows if r["model"] == model and r["runner"] == "engine" and
           r["workload"] == "prefill"}
    eager = {r["length"]: r for r in rows if r["model"] == model and r["runner"] == "engine-eager" and
             r["workload"] == "prefill"}
    ttft = {r["length"]: r for r in rows if r["model"] == model and r["runner"] == "engine" and
            r["workload"] == "ttft"}

    def beside(n: int) -> str:
        return f" (eager {eager[n]['median_s'] * 1e3:.2f} ms)" if n in eager else ""

    if on_gpu:
        for n, limit in PREFILL_TARGETS.items():
            if n in pre:
                out.append(_target(model, f"prefill of {n} tokens <= {limit * 1e3:.1f} ms",
                                   f"{pre[n]['median_s'] * 1e3:.2f} ms{beside(n)}", pre[n]["median_s"] <= limit))
        n, fraction = PREFILL_COMPUTE
        if n in pre:
            out.append(_target(model, f"prefill of {n} tokens >= {100 * fraction:.0f}% of its compute floor",
                               f"{100 * pre[n]['fraction_of_floor']:.0f}% ({pre[n]['median_s'] * 1e3:.2f} ms"
                               f"{beside(n)})", pre[n]["fraction_of_floor"] >= fraction))
    if ttft:
        reached = ", ".join(f"{n}: {r['median_s'] * 1e3:.2f} ms" for n, r in sorted(ttft.items()))
        out.append(_target(model, "time to first token by prompt length (one request, through the driver)",
                           reached, "-"))
    return out


PROFILE_COLUMNS = ["model", "batch_size", "step_s", "replay_s", "replay_p10_s", "replay_p90_s", "kernels_per_step",
                   "kernels_per_layer", "host_build_s", "host_plan_s", "host_sample_prep_s", "host_launch_s",
                   "host_process_s", "host_wait_s", "host_busy_s", "bound"]


PREFILL_PROFILE_COLUMNS = ["model", "length", "step_s", "replay_s", "kernels_per_step", "host_build_s", "host_plan_s",
                           "host_sample_prep_s", "host_launch_s", "host_process_s", "host_wait_s", "host_busy_s",
                           "bound"]


def _prefill_section(profiles: List[Dict[str, Any]]) -> str:
    """Per prompt length: the prefill step through the driver beside its graph's GPU time and the host's parts."""
    if not profiles:
        return ""
    md = ("## Where a prefill's time goes\n"
          "One request alone (the prefill rows above): step_s from its scheduling to its token processed; replay_s "
          "the GPU time of the prefill CUDA graph of its token bucket replayed alone (CUDA events, median of 20; the "
          "LM head and sampling run after it, outside the graph); kernels_per_step from torch.profiler over 5 "
          "replays; host_* the driver's timers by part as in the decode table (plan: the page lists and FlashInfer's "
          "prefill plan; wait: blocked on the token). Nothing overlaps a lone prefill: its step is about host busy + "
          f"wait.\n\n{markdown_table(profiles, PREFILL_PROFILE_COLUMNS)}\n")
    for p in profiles:
        if p["length"] == min(q["length"] for q in profiles) and p.get("top_kernels"):
            md += (f"Largest kernels of a {p['model']} prefill graph of {p['length']} tokens (GPU us per replay):\n\n"
                   f"{markdown_table(p['top_kernels'])}\n")
    return md


def _profile_section(profiles: List[Dict[str, Any]]) -> str:
    """Per decode batch size: kernels, replay GPU time, host time by part, the bound; the biggest kernels at bs 1."""
    graphs = [p for p in profiles if p["runner"] == "engine"]
    if not graphs:
        return ""
    md = ("## Where a decode step's time goes\n"
          "Per batch size (context 512): step_s is the step's period through the driver (overlap on: step N + 1 is "
          "built and launched while step N runs); replay_s the decode CUDA graph's GPU time alone (CUDA events, "
          "median of 50 replays of a step at context 512: the graph as one such step left it); kernels_per_step from "
          "torch.profiler over 10 replays (copies and memsets not counted), per layer = kernels / layers (the "
          "embedding, final norm and LM head included); host_* the driver's own timers by part, medians (build: "
          "batch and inputs; plan: attention page lists and FlashInfer plan; sample_prep: Sampler.prepare; launch: "
          "forward_batch's host side and the token feedback; process: reading the tokens a step late; wait: blocked "
          "on them). host_busy is the sum of the parts the host works in; with overlap a step takes about max(host "
          "busy, GPU).\n\n"
          f"{markdown_table(graphs, PROFILE_COLUMNS)}\n")
    cats = [{"model": p["model"], "batch_size": p["batch_size"], "replay_us": p["replay_s"] * 1e6,
             **{k: v for k, v in sorted(by_category(p["top_kernels"]).items(), key=lambda kv: -kv[1])}}
            for p in graphs if p["batch_size"] in (1, 256) and p.get("top_kernels")]
    if cats:
        head = ["model", "batch_size", "replay_us"]
        kinds = list(dict.fromkeys(k for c in cats for k in c if k not in head))
        md += ("GPU us per step by kind of kernel, from the 12 largest kernels of the replay (the rest is small "
               f"kernels and the gaps between them):\n\n{markdown_table(cats, head + kinds)}\n")
    for p in graphs:
        if p["batch_size"] in (1, 256) and p.get("top_kernels"):
            md += (f"Largest kernels of a {p['model']} decode step at batch {p['batch_size']} (GPU us per step):\n\n"
                   f"{markdown_table(p['top_kernels'])}\n")
    return md


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


PER_MODEL = ("rows", "profiles", "prefill_profiles", "gemms", "unfit")  # the result's lists, each row naming its model


def _unfit_lines(unfit: List[Dict[str, Any]]) -> List[str]:
    """The rows the engine's KV pool cannot hold, a line each: not run."""
    return [f"{u['runner']} {u['workload']} bs {u['batch_size']} len {u['length']}: not run, its requests need "
            f"{u['pages_needed']:,} KV pages at once and the pool has {u['pages_in_pool']:,}" for u in unfit]


def model_result(result: Dict[str, Any], model: str) -> Dict[str, Any]:
    """The part of a run's result that is one model's."""
    return dict(result, **{k: [r for r in result.get(k, []) if r.get("model") == model] for k in PER_MODEL})


def report_dir(device: str, model: str, update: bool) -> Path:
    return report_root(update) / "bench" / device.split(":")[0] / model


def write_bench_report(result: Dict[str, Any], update: bool = False) -> str:
    """One report per model of the run; returns what to print."""
    lim = result["limits"]
    lines = [f"bench on {result['device']}: {lim['bandwidth'] / 1e9:.1f} GB/s, {lim['matmul_flops'] / 1e12:.2f} TFLOP/s"]
    for model in dict.fromkeys(r["model"] for r in result["rows"]):
        lines += _write_model_report(model_result(result, model), report_dir(result["device"], model, update), update)
    return "\n".join(lines)


def _write_model_report(result: Dict[str, Any], out: Path, update: bool) -> List[str]:
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    rows = result["rows"]
    frame = pd.DataFrame(rows)
    frame.to_csv(out / "bench.csv", index=False)
    # a result read back from its bench.json keeps the provenance of the run that measured it
    prov = result.get("provenance") or provenance(result["device"], dtype=result["dtype"])
    tgt = targets(result)
    write_json(out / "bench.json", dict(result, provenance=prov, targets=tgt))
    plots = _plots(rows, out)
    unfit = _unfit_lines(result.get("unfit", []))
    lim = result["limits"]
    md = (f"# Benchmarks on {prov['device_name']} ({result['dtype']})\n\n"
          + (f"{result['note']}\n\n" if result.get("note") else "") +
          f"Measured in this run: bandwidth {lim['bandwidth'] / 1e9:.1f} GB/s (a large device copy, read + write), "
          f"matmul {lim['matmul_flops'] / 1e12:.2f} TFLOP/s ({result['dtype']}). A floor is max(bytes / bandwidth, "
          "FLOPs / matmul rate) for what the forward must move: every weight once (the embedding as the LM head; of a "
          "mixture of experts, the experts the step touches: E (1 - (1 - k/E)^tokens) per layer under uniform "
          "routing, k at batch 1, about all at large batches), the KV it reads and writes; FLOPs: every matmul, the LM "
          "head's on the rows that get logits (a prefill's last token; HF's forward, every position). The matmul "
          "rate is the best of several large GEMMs in this process. fraction_of_floor = "
          "floor / measured (1.0 would be the limit). The engine is "
          "timed through the driver (host preparation, forward, sampling, the tokens' way back; engine-simple is the "
          "driver's loop without overlap). HF generate on the same model, dtype and inputs: `hf` eager (sdpa), "
          "`hf-static` with cache_implementation='static', which transformers compiles (torch.compile, CUDA graphs; "
          "warmup_s is its first call, compilation included, left out of the timings). HF's decode step: one sample "
          "per generated token, the interval between two calls of a synchronizing logits processor, after two "
          "warm-up calls, 3 runs. Medians; p10/p90 beside them.\n\n"
          f"## Targets\n{markdown_table(tgt)}\n{anchors_section(result)}{_profile_section(result.get('profiles', []))}"
          f"{_prefill_section(result.get('prefill_profiles', []))}"
          f"{gemm_section(result.get('gemms', []))}"
          + ("## Rows the KV pool cannot hold\nThe batch sizes follow the KV pool the engine got beside its weights "
             "(a row whose requests need more pages at once than it has is not run; the largest batch it holds, "
             "rounded down to a multiple of 8, takes its place):\n\n" + "".join(f"- {line}\n" for line in unfit) +
             "\n" if unfit else "") +
          "## Every measurement\n"
          f"{markdown_table(rows, [c for c in COLUMNS if c in frame.columns])}\n"
          "offline: the nano-vllm / mini-sglang workload (random.seed(0), input and output lengths randint"
          f"{tuple(result['spec']['offline'][1:])}, {result['spec']['offline'][0]} requests, EOS ignored, tokens "
          f"actually produced counted, sampled at temperature 0.6 as nano-vllm samples it); offline_greedy: the same "
          f"requests greedy; offline_alternating: the same as offline with alternating steps (Driver(mixed=False): "
          "no request admitted beside the running ones' decodes); offline_subset: its first "
          f"{result['spec']['hf_offline'][0]} requests with "
          f"outputs capped at {result['spec']['hf_offline'][1]} tokens, run by both the engine and HF.\n\n"
          + "".join(f"![{p}]({p})\n" for p in plots) +
          f"\n## Provenance\n{provenance_markdown(prov)}")
    (out / "summary.md").write_text(md)
    verdict = {True: "met", False: "NOT met", "-": "-"}
    return ([f"  {t['model']}: {t['target']}: {t['reached']} ({verdict[t['met']]})" for t in tgt]
            + [f"  {line}" for line in unfit] + [written_to(out / "summary.md", update)])
