"""python -m harness.bench.host_profile --model NAME [--device cuda]: where the host's time goes in prefill and decode
steps through the driver, function by function.

For each prefill length and decode batch size: the driver's own timers by part (harness/bench/profile.py's host_parts:
build, plan, sample_prep, launch, process, wait, medians), the host functions a step calls (TIMED), each timed by a
wrapper around it (us a step: all its calls' time over the run's steps; median us a call and calls a step; nested: a
caller's time includes its callees'; a wrapper costs well under a microsecond, so these compare with the parts; read a
function called more than once a step by its us a step: its calls may do different work, as the scheduler's, which
admits on one call and releases on the next, and a median of those is neither), cProfile over a run of them (the
Python functions, by own and by cumulative time: cProfile's own overhead inflates both, so compare within a table, not
with the timers), torch.profiler's table of aten ops and CUDA runtime calls for the smallest prefill and batch
(CUPTI's tracing slows cudaGraphLaunch several times over: read its row from cProfile's torch/cuda/graphs.py replay
instead), and on CUDA the replayed graph's GPU time by kind of kernel. Host speed differs between machines of one kind
by up to 1.5x: compare two revisions in one run (`python -m harness bench --against`), or normalise by a part both
share.
Writes OUT/summary.json, OUT/cprofile_<step>.txt and OUT/torch_<step>.txt, and prints the timers.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib
import io
import json
import pstats
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import torch

from engine import Engine, EngineConfig
from engine.core import SamplingParams
from engine.distributed import DistributedInfo
from harness.bench.profile import by_category, host_parts, profile_prefill, profile_replay
from harness.bench.workloads import engine_decode, engine_prefill, random_ids
from harness.driver import Driver
from harness.models import ModelRef, add_model_arguments, as_model, resolve_model

SIZES = {"cuda": ([128, 512, 4096], [1, 256], 512), "cpu": ([32, 128], [1, 8], 64)}  # prefill lengths, bs, context
# the host functions of a step: (module, class, methods)
TIMED = (("harness.driver", "Driver", ("_schedule", "_admit", "_make_step", "_prefill_inputs", "_decode_inputs",
                                       "_launch", "_feed_back", "_process", "_release")),
         ("harness.driver", "PageAllocator", ("alloc", "free")),
         ("engine.attention.flashinfer_backend", "FlashInferBackend",
          ("prepare_metadata", "_page_lists", "_fast_prefill_plan", "_plan_graph")),
         ("engine.attention.torch_backend", "TorchBackend", ("prepare_metadata",)),
         ("engine.attention.cpu_backend", "CpuBackend", ("prepare_metadata",)),
         ("engine.graph", "GraphRunner", ("replay", "_load")),
         ("engine.engine", "Engine", ("forward_batch", "_check_prefill")),
         ("engine.sample", "Sampler", ("prepare", "sample")))


@contextmanager
def timed_functions() -> Iterator[Dict[str, List[float]]]:
    """Every TIMED method wrapped in a timer while the block runs: label -> the seconds of each call."""
    calls: Dict[str, List[float]] = defaultdict(list)
    saved = []

    def timed(label: str, f: Callable) -> Callable:
        @functools.wraps(f)
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                calls[label].append(time.perf_counter() - t)
        return run

    try:
        for module, name, methods in TIMED:
            owner = getattr(importlib.import_module(module), name)
            for m in methods:
                saved.append((owner, m, owner.__dict__[m]))
                setattr(owner, m, timed(f"{name}.{m}", owner.__dict__[m]))
        yield calls
    finally:
        for owner, m, f in saved:
            setattr(owner, m, f)


def function_table(calls: Dict[str, List[float]], steps: int) -> Dict[str, Dict[str, float]]:
    """label -> us a step (all its calls over the run's steps: a decode run's prefill among them), median us a call
    and calls a step, the most time a step first."""
    rows = {label: {"us_per_step": sum(t) / steps * 1e6, "median_us": statistics.median(t) * 1e6,
                    "calls_per_step": len(t) / steps} for label, t in calls.items()}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["us_per_step"]))


def _stats(prof: cProfile.Profile, key: str, rows: int = 40) -> str:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(key).print_stats(rows)
    return out.getvalue()


def _cprofile(run: Callable[[], Any], path: Path) -> None:
    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    path.write_text(_stats(prof, "tottime") + _stats(prof, "cumulative", 60))


def _torch_profile(run: Callable[[], Any], path: Path, cuda: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        run()
    path.write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45,
                                              max_name_column_width=70))


def host_profile(model: ModelRef | str, device: str, out: Path, repeats: int = 10) -> Dict[str, Any]:
    cuda = device.startswith("cuda")
    lengths, sizes, ctx = SIZES["cuda" if cuda else "cpu"]
    ref = as_model(model)
    model = ref.name
    engine = Engine(EngineConfig(
        model_path=str(ref.folder), tp_info=DistributedInfo(0, 1), dtype=torch.bfloat16 if cuda else torch.float32,
        device=device, max_running_req=max(sizes), use_dummy_weight=not ref.has_weights,
        max_seq_len_override=max(max(lengths), ctx + 2 * repeats + 8) + 64))
    vocab = engine.config.model_config.vocab_size
    driver = Driver(engine, mixed=False)  # every prompt prefilled before the decode steps it profiles
    out.mkdir(parents=True, exist_ok=True)
    summary: Dict[str, Any] = {"model": model, "device": device}

    def step(name: str, records: list, run: Callable[[int], None], first: bool, replay: Callable[[], Any]) -> None:
        """The timers of records, the functions' timers over run(2 x repeats) (the steps it took counted), cProfile
        over run(2 x repeats), torch.profiler over run(5) for the first size, then the graph this step replays (as
        the last run left it)."""
        summary[name] = {"host": host_parts(records)}
        before = len(driver.steps)
        with timed_functions() as calls:
            run(2 * repeats)
        summary[name]["functions"] = function_table(calls, max(1, len(driver.steps) - before))
        _cprofile(lambda: run(2 * repeats), out / f"cprofile_{name}.txt")
        if first:
            _torch_profile(lambda: run(5), out / f"torch_{name}.txt", cuda)
        profile = replay() if cuda else None
        if profile is not None:
            summary[name].update(replay_s=profile.replay_s, gpu_us_by_kind=by_category(profile.top_kernels))

    try:
        for n in lengths:
            ids = random_ids(n, vocab, seed=n)
            step(f"prefill{n}", engine_prefill(driver, n, vocab, repeats),
                 lambda times: [driver.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))
                                for _ in range(times)],
                 n == lengths[0], lambda: profile_prefill(engine, n))
        for bs in sizes:
            prompts = [random_ids(ctx, vocab, seed=1000 + i) for i in range(bs)]
            step(f"decode{bs}", engine_decode(driver, bs, ctx, 2 * repeats, vocab),
                 lambda steps: driver.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True)),
                 bs == sizes[0], lambda: profile_replay(engine, bs))
    finally:
        engine.shutdown()
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.bench.host_profile", description=__doc__.split("\n\n")[0])
    add_model_arguments(p, "qwen3-0.6b", many=False)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=Path("build/host-profile"))
    p.add_argument("--repeats", type=int, default=10, help="timed prefills per length (decode: twice as many steps)")
    args = p.parse_args(argv)
    model = resolve_model(args, "qwen3-0.6b", weights=False, tokenizer=False, verb="host_profile")
    summary = host_profile(model, args.device, args.out, args.repeats)
    for name, part in summary.items():
        if isinstance(part, dict):
            host = " ".join(f"{k} {v * 1e3:.3f}" for k, v in part["host"].items())
            gpu = f"; graph replay {part['replay_s'] * 1e3:.3f} ms" if "replay_s" in part else ""
            print(f"{name}: host ms: {host}{gpu}")
            rows = part["functions"].items()
            print("  us a step (median us a call x calls a step): " + ", ".join(
                f"{label} {r['us_per_step']:.0f} ({r['median_us']:.0f} x {r['calls_per_step']:.2g})"
                for label, r in rows))
    print(f"wrote {args.out}/summary.json, cprofile_*.txt, torch_*.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
