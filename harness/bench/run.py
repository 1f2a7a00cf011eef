"""python -m harness bench: throughput and latency of the engine beside HF generate and the hardware's limit.

Every figure comes from this one run: the engine (through the driver, host work included), HF transformers on the
same model, dtype and workload (eager, and on CUDA with a static cache compiled by transformers), and the limit (a
large copy for bandwidth, a large matmul for FLOP/s) measured on the same device. On CUDA each decode batch size is
also profiled (and each prefill length): kernels per step, the graph replay's GPU time and the host's time by part,
which name the bound.
Writes build/reports/bench/<device>/<model>/ for each model (reports/bench/<device>/<model>/ with
--update-reports): bench.csv, bench.json, summary.md, *.png.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, Dict, List

import torch

from engine import Engine, EngineConfig
from engine.distributed import DistributedInfo
from harness import EXIT_PASS, UserError, check_device, progress
from harness.bench.limits import Limits, ModelCost, measure_limits, model_cost
from harness.bench.long_context import bench_long
from harness.bench.profile import bound, host_parts, prefill_bound, profile_prefill, profile_replay
from harness.bench.report import write_bench_report
from harness.bench.gemm import gemm_rows
from harness.bench.workloads import (SPECS, BenchSpec, decode_at, decode_pages, engine_decode, engine_offline,
                                     engine_prefill, engine_ttft, fit_batches, hf_decode, hf_offline, hf_prefill,
                                     median, offline_workload, spread)
from harness.driver import Driver
from harness.models import ModelRef, as_model, resolve_models

logger = logging.getLogger(__name__)
DEFAULT_MODELS = {"cpu": ["smollm2-135m", "gemma3-270m"], "cuda": ["qwen3-0.6b", "smollm2-135m"]}
DTYPES = {"cpu": "float32", "cuda": "bfloat16"}


def _row(model: str, runner: str, workload: str, bs: int, length: int, secs: List[float], tokens: int,
         cost: ModelCost, limits: Limits, forward: tuple[int, ...]) -> Dict[str, Any]:
    """One measurement with its physics: tokens/s, the floor from bytes and FLOPs, achieved GB/s and TFLOP/s."""
    med = median(secs)
    p10, p90 = spread(secs)
    nbytes, flops = cost.forward(*forward)
    floor = limits.floor_seconds(nbytes, flops)
    return {"model": model, "runner": runner, "workload": workload, "batch_size": bs, "length": length,
            "median_s": med, "p10_s": p10, "p90_s": p90, "samples": len(secs), "tokens_per_s": tokens / med,
            "floor_s": floor, "fraction_of_floor": floor / med, "achieved_GBps": nbytes / med / 1e9,
            "achieved_TFLOPs": flops / med / 1e12}


def _progress(row: Dict[str, Any], clock: progress.Stopwatch) -> Dict[str, Any]:
    """The row, after its line: what was measured, its median, the seconds since the previous line."""
    bs = f" bs {row['batch_size']}" if "batch_size" in row else ""
    what = f"{row['model']} {row['runner']} {row['workload']}{bs} len {row['length']}"
    progress.line("bench", what, f"{1e3 * row['median_s']:.4g} ms", clock.lap())
    return row


def _engine(model: ModelRef, device: str, dtype: str, spec: BenchSpec, graphs: bool,
            batch_invariant: bool = False, **config: Any) -> Engine:
    """config: further EngineConfig fields (a test's small KV pool: num_page_override)."""
    return Engine(EngineConfig(
        model_path=str(model.folder), tp_info=DistributedInfo(0, 1), dtype=getattr(torch, dtype), device=device,
        max_running_req=max(max(spec.decode_bs), spec.offline[0]), use_dummy_weight=not model.has_weights,
        max_seq_len_override=max(max(spec.prefill_lengths), max(spec.latency_ctx), 2 * spec.offline[2]) + 64,
        cuda_graph_max_bs=None if graphs else 0, batch_invariant=batch_invariant, **config))


def _unfit(model: str, runner: str, workload: str, bs: int, ctx: int, need: int, have: int,
           clock: progress.Stopwatch) -> Dict[str, Any]:
    """A row the KV pool cannot hold: its requests need more pages at once than the engine's pool has. Not run; said."""
    row = {"model": model, "runner": runner, "workload": workload, "batch_size": bs, "length": ctx,
           "pages_needed": need, "pages_in_pool": have}
    progress.line("bench", f"{model} {runner} {workload} bs {bs} len {ctx}", "does not fit", clock.lap())
    return row


def _hf(model: ModelRef, device: str, dtype: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    path, torch_dtype = model.folder, getattr(torch, dtype)
    if model.has_weights:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device).eval()
    with torch.device(device):  # dummy weights made where they run (qwen3-30b-a3b's 61 GB never visit the host)
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch_dtype).eval()


def _decode_rows(model: str, runner: str, driver: Driver, bs: int, ctx: int, spec: BenchSpec, vocab: int,
                 cost: ModelCost, limits: Limits, workload: str = "decode") -> tuple[Dict[str, Any], List]:
    records = engine_decode(driver, bs, ctx, spec.decode_steps, vocab)
    row = _row(model, runner, workload, bs, ctx, [r.seconds for r in records], bs, cost, limits,
               (bs, bs * ctx, bs * (ctx + 1)))
    return row, records


def bench_model(ref: ModelRef | str, device: str, spec: BenchSpec, limits: Limits, with_hf: bool,
                **config: Any) -> tuple[List, List, List, List, List]:
    """(rows, decode profiles, GEMMs at M = 1 on CUDA, prefill profiles on CUDA, rows the KV pool cannot hold) of one
    model. Decode batch sizes follow the KV pool the engine got (workloads.fit_batches); config: further EngineConfig
    fields."""
    ref = as_model(ref)
    model = ref.name
    dtype = DTYPES[device.split(":")[0]]
    rows: List[Dict[str, Any]] = []
    profiles: List[Dict[str, Any]] = []
    prefills: List[Dict[str, Any]] = []
    gemms: List[Dict[str, Any]] = []
    unfit: List[Dict[str, Any]] = []
    prompts, outs = offline_workload(*spec.offline)
    n_hf, cap = spec.hf_offline
    sub_prompts, sub_outs = prompts[:n_hf], [min(o, cap) for o in outs[:n_hf]]
    on_gpu, clock = device.startswith("cuda"), progress.Stopwatch()
    for runner, graphs in [("engine", True)] + ([("engine-eager", False)] if on_gpu and spec.eager else []):
        engine = _engine(ref, device, dtype, spec, graphs, **config)
        cost, vocab = model_cost(engine), engine.config.model_config.vocab_size
        # the driver's defaults, as a user's: at its prefill budget (4096 tokens) 36 of the offline workload's 38
        # prefill batches replay prefill graphs (up to 4096 tokens and 8 requests), where at 8192 18 of 19 ran
        # eagerly (the offline run on the H200, one engine, alternating: 5.784 / 5.746 s at 8192, 5.721 / 5.710 at 4096)
        driver = Driver(engine)
        pool, per_request = driver.pages.num_pages, decode_pages(spec.decode_ctx, spec.decode_steps, driver.page_size)
        try:
            batches, refused = fit_batches(spec.decode_bs, per_request, pool)
            unfit += [_unfit(model, runner, "decode", bs, spec.decode_ctx, bs * per_request, pool, clock)
                      for bs in refused]
            for bs in batches:
                row, records = _decode_rows(model, runner, driver, bs, spec.decode_ctx, spec, vocab, cost, limits)
                rows.append(_progress(row, clock))
                if on_gpu:
                    profiles.append(_profile(model, runner, engine, bs, records, driver, spec.decode_ctx, vocab))
            for ctx in spec.latency_ctx:
                need = decode_pages(ctx, spec.decode_steps, driver.page_size)
                if need > pool:
                    unfit.append(_unfit(model, runner, "decode_ctx", 1, ctx, need, pool, clock))
                    continue
                rows.append(_progress(_decode_rows(model, runner, driver, 1, ctx, spec, vocab, cost, limits,
                                                   "decode_ctx")[0], clock))
            for n in spec.prefill_lengths:
                pairs = n * (n + 1) // 2
                records = engine_prefill(driver, n, vocab, spec.repeats)
                rows.append(_progress(_row(model, runner, "prefill", 1, n, [r.seconds for r in records], n, cost,
                                           limits, (n, 0, pairs, 1)), clock))
                if on_gpu and runner == "engine":
                    prefills.append(_prefill_profile(model, engine, n, records))
                secs = engine_ttft(driver, n, vocab, spec.repeats)
                rows.append(_progress(_row(model, runner, "ttft", 1, n, secs, n, cost, limits, (n, 0, pairs, 1)),
                                      clock))
            if runner != "engine":
                continue
            simple = Driver(engine, overlap=False)
            batches, refused = fit_batches(spec.simple_bs, per_request, pool)
            unfit += [_unfit(model, "engine-simple", "decode", bs, spec.decode_ctx, bs * per_request, pool, clock)
                      for bs in refused]
            for bs in batches:
                rows.append(_progress(_decode_rows(model, "engine-simple", simple, bs, spec.decode_ctx, spec, vocab,
                                                   cost, limits)[0], clock))
            # offline_greedy: the same requests at temperature 0, so the difference is what sampling costs;
            # offline_alternating: the same as offline with alternating steps, so the difference is what mixing them
            # (the requests admitted beside the running ones' decodes) gains or costs
            for name, (ps, os_) in (("offline", (prompts, outs)), ("offline_greedy", (prompts, outs)),
                                    ("offline_subset", (sub_prompts, sub_outs)),
                                    ("offline_alternating", (prompts, outs))):
                run = engine_offline(Driver(engine, mixed=False) if name == "offline_alternating" else driver, ps, os_,
                                     greedy=name in ("offline_greedy", "offline_subset"))
                rows.append(_progress(_offline_row(model, runner, name, run, cost, limits), clock))
            # last: on the H200 the same offline run after these synthetic GEMM graphs took 2.3% longer (5.80 ->
            # 5.93 s, a fresh driver each time; the same clocks and temperature), the workloads before them did not
            if on_gpu:
                gemms += gemm_rows(model, engine, limits)
        finally:
            engine.shutdown()
    if spec.long_prompts or spec.itl:
        rows += bench_long(model, device, dtype, spec, limits, _row)
    if with_hf:
        rows += _bench_hf(ref, device, dtype, spec, limits, cost, vocab, sub_prompts, sub_outs)
    return rows, profiles, gemms, prefills, unfit


def _host_columns(host: Dict[str, float]) -> Dict[str, float]:
    """host_parts' medians as report columns: host_build_s, ..., host_busy_s."""
    return {f"{k if k.startswith('host_') else 'host_' + k}_s": v for k, v in host.items()}


def _prefill_profile(model: str, engine: Engine, tokens: int, records: List) -> Dict[str, Any]:
    host = host_parts(records)
    replay = profile_prefill(engine, tokens)
    out = {"model": model, "length": tokens, "step_s": host.pop("period"),
           **_host_columns(host),
           "bound": prefill_bound(host, replay and replay.replay_s)}
    if replay is not None:
        out.update(replay_s=replay.replay_s, kernels_per_step=replay.kernels_per_step, top_kernels=replay.top_kernels)
    return out


def _profile(model: str, runner: str, engine: Engine, bs: int, records: List, driver: Driver, ctx: int,
             vocab: int) -> Dict[str, Any]:
    """The decode rows' host parts; the graph's replay profiled after one step at their average context."""
    host = host_parts(records)
    replay = None
    if runner == "engine":
        decode_at(driver, bs, ctx, vocab)
        replay = profile_replay(engine, bs)
    layers = engine.config.model_config.num_layers
    out = {"model": model, "runner": runner, "batch_size": bs, "step_s": host.pop("period"),
           **_host_columns(host),
           "bound": bound(host, replay and replay.replay_s)}
    if replay is not None:
        out.update(replay_s=replay.replay_s, replay_p10_s=replay.replay_p10_s, replay_p90_s=replay.replay_p90_s,
                   kernels_per_step=replay.kernels_per_step, kernels_per_layer=replay.kernels_per_step / layers,
                   copies_per_step=replay.copies_per_step, top_kernels=replay.top_kernels)
    return out


def _offline_row(model: str, runner: str, name: str, run: Any, cost: ModelCost, limits: Limits) -> Dict[str, Any]:
    """Whole-run floor: every step's bytes and FLOPs (from the driver's log) over the measured limits."""
    floor = 0.0
    for s in run.steps:
        nbytes_flops = cost.forward(s.num_tokens, s.kv_tokens - s.num_tokens, s.pairs, rows=s.batch_size)
        floor += limits.floor_seconds(*nbytes_flops)
    return {"model": model, "runner": runner, "workload": name, "batch_size": len(run.steps) and max(
        s.batch_size for s in run.steps), "length": run.output_tokens, "median_s": run.seconds, "samples": 1,
            "tokens_per_s": run.output_tokens / run.seconds, "floor_s": floor or float("nan"),
            "fraction_of_floor": floor / run.seconds if floor else float("nan")}


def _bench_hf(ref: ModelRef, device: str, dtype: str, spec: BenchSpec, limits: Limits, cost: ModelCost, vocab: int,
              sub_prompts: List[List[int]], sub_outs: List[int]) -> List[Dict[str, Any]]:
    hf, dev, model, clock = _hf(ref, device, dtype), torch.device(device), ref.name, progress.Stopwatch()
    rows = []
    for runner, sizes, static in (("hf", spec.hf_decode_bs, False), ("hf-static", spec.hf_static_bs, True)):
        for bs in sizes:
            secs, warmup = hf_decode(hf, bs, spec.decode_ctx, spec.decode_steps, vocab, dev, static=static)
            rows.append(_progress(dict(_row(model, runner, "decode", bs, spec.decode_ctx, secs, bs, cost, limits,
                                            (bs, bs * spec.decode_ctx, bs * (spec.decode_ctx + 1))), warmup_s=warmup),
                                  clock))
    ctx = spec.latency_ctx[-1]
    secs, _ = hf_decode(hf, 1, ctx, spec.decode_steps, vocab, dev)
    rows.append(_progress(_row(model, "hf", "decode_ctx", 1, ctx, secs, 1, cost, limits, (1, ctx, ctx + 1)), clock))
    for n in spec.prefill_lengths:
        secs = hf_prefill(hf, n, vocab, spec.repeats, dev)
        # HF's forward computes the logits of every position
        rows.append(_progress(_row(model, "hf", "prefill", 1, n, secs, n, cost, limits, (n, 0, n * (n + 1) // 2)),
                              clock))
    run = hf_offline(hf, sub_prompts, sub_outs, dev)
    rows.append(_progress({"model": model, "runner": "hf", "workload": "offline_subset", "length": run.output_tokens,
                           "median_s": run.seconds, "samples": 1, "tokens_per_s": run.output_tokens / run.seconds},
                          clock))
    del hf
    return rows


def run_bench(device: str, models: List[ModelRef | str], with_hf: bool = True) -> Dict[str, Any]:
    dev = torch.device(device if device != "cuda" else "cuda:0")
    refs = [as_model(m) for m in models]
    models = [r.name for r in refs]
    moe = [r.is_moe for r in refs]
    if any(moe) and not all(moe):
        raise UserError(f"--model {' '.join(models)}: bench mixture-of-experts models apart from dense ones (they run "
                        "another spec); run one of each kind at a time")
    spec = SPECS[f"{dev.type}-moe" if all(moe) and f"{dev.type}-moe" in SPECS else dev.type]
    limits = measure_limits(dev, getattr(torch, DTYPES[dev.type]))
    logger.info("limits: %.1f GB/s, %.2f TFLOP/s", limits.bandwidth / 1e9, limits.matmul_flops / 1e12)
    rows, profiles, gemms, prefills, unfit = [], [], [], [], []
    for ref in refs:
        r, p, g, f, u = bench_model(ref, str(dev), spec, limits, with_hf)
        rows, profiles, gemms, prefills, unfit = rows + r, profiles + p, gemms + g, prefills + f, unfit + u
    return {"device": str(dev), "dtype": DTYPES[dev.type], "limits": vars(limits), "spec": vars(spec), "rows": rows,
            "profiles": profiles, "prefill_profiles": prefills, "gemms": gemms, "unfit": unfit}


def command(args: argparse.Namespace) -> int:
    device = args.device
    check_device(device, flashinfer=device.startswith("cuda"))  # on CUDA the engine's numbers are FlashInfer's
    models = resolve_models(args, DEFAULT_MODELS["cuda" if device.startswith("cuda") else "cpu"], weights=False,
                            tokenizer=False, verb="bench")
    result = run_bench(device, models, with_hf=not args.no_hf)
    print(write_bench_report(result, update=args.update_reports))
    return EXIT_PASS
