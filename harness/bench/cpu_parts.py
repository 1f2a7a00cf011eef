"""python -m harness.bench.cpu_parts --model NAME: where a CPU step's time goes, by part of the engine.

On the CPU every op runs synchronously on the calling thread's team, so the time inside a call is its work. Each part
is a method of the engine's own objects (its ops, its attention backend, its KV pool, its sampler) or the driver's,
timed by a wrapper on that object (so a subclass's override is timed too); a part's time is exclusive: the parts called
inside it are subtracted (the activation inside the down projection's linear is the activation's, not the GEMM's). What
a forward spends outside every part is the model's Python glue (views, the residual stream's bookkeeping, the logits'
rows). A step is the sum of its parts. torch.profiler's table of one run of each kind counts the aten ops and their
time (the attention's gather and SDPA, the GEMM calls). Decode steps of 1, 8 and 32 requests over a context of about
CTX tokens; prefills of one prompt of 128, 512 and 2048 tokens.

--threads 1 times each part by the thread's CPU time (time.thread_time: torch runs every op on the calling thread),
which a busy host does not stretch: the work by part, whatever else runs. At more threads the clock is the wall's,
which on a host with more runnable threads than cores also counts the waits of a team whose threads were descheduled.
Writes OUT/summary.json and OUT/torch_<step>.txt, and prints ms a step by part.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Sequence

import torch

from engine import Engine, EngineConfig
from engine.core import SamplingParams
from engine.distributed import DistributedInfo
from harness.bench.workloads import decode_prompt_len, random_ids, settle
from harness.driver import Driver
from harness.models import add_model_arguments, as_model, resolve_model

PREFILLS, DECODE_BS, CTX, STEPS = (128, 512, 2048), (1, 8, 32), 128, 8
# part -> (the engine's object, by attribute path from the engine; its methods)
PARTS = {
    "gemm": ("engine.model.ops", ("linear", "router")),
    "activation": ("engine.model.ops", ("act_and_mul",)),
    "lm head": ("engine.model.ops", ("lm_head",)),
    "norm": ("engine.model.ops", ("rmsnorm", "add_rmsnorm", "head_rmsnorm_")),
    "rotary": ("engine.model.ops", ("rope_",)),
    "q/k + rope + kv store": ("engine.model.ops", ("qk_rope_store_",)),
    "kv store": ("engine.kv_cache", ("store_kv",)),
    "attention": ("engine.attn_backend", ("forward",)),
    "attention metadata": ("engine.attn_backend", ("prepare_metadata",)),  # called by the driver
    "embedding": ("engine.model.model.embed_tokens", ("forward",)),
    "sampler": ("engine.sampler", ("sample",)),
    "sampler prep": ("engine.sampler", ("prepare",)),  # called by the driver
    "forward_batch": ("engine", ("forward_batch",)),  # the rest of a forward: the model's Python glue
    "driver": ("driver", ("_schedule", "_launch", "_process")),  # building batches, processing tokens
}
GLUE = "model glue (Python, views)"


def _owner(roots: Dict[str, Any], path: str) -> Any:
    first, *rest = path.split(".")
    return functools.reduce(getattr, rest, roots[first])


@contextmanager
def part_timers(roots: Dict[str, Any], parts: Dict[str, tuple] = PARTS,
                clock: Callable[[], float] = time.perf_counter) -> Iterator[List[Dict[str, float]]]:
    """Every method of parts timed on the objects roots name ({"engine": ..., "driver": ...}) while the block runs;
    yields one dict per forward_batch
    call as the calls end: part -> exclusive seconds of the calls since the previous forward ended (the driver's
    metadata and sampler preparation before it among them), forward_batch's own under GLUE and its whole time."""
    forwards: List[Dict[str, float]] = []
    step: Dict[str, float] = {}
    stack: List[float] = []  # per open call: the time of the parts called inside it so far

    def timed(part: str, f: Callable) -> Callable:
        @functools.wraps(f)
        def run(*args, **kwargs):
            stack.append(0.0)
            t = clock()
            try:
                return f(*args, **kwargs)
            finally:
                took = clock() - t
                inner = stack.pop()
                name = GLUE if part == "forward_batch" else part
                step[name] = step.get(name, 0.0) + took - inner
                if stack:
                    stack[-1] += took
                if part == "forward_batch":
                    forwards.append({**step, "forward_batch": took})
                    step.clear()
        return run

    wrapped = []
    try:
        for part, (path, methods) in parts.items():
            owner = _owner(roots, path)
            for m in methods:
                if hasattr(owner, m):
                    setattr(owner, m, timed(part, getattr(owner, m)))  # an instance attribute over the method
                    wrapped.append((owner, m))
        yield forwards
    finally:
        for owner, m in wrapped:
            delattr(owner, m)


def _torch_table(run: Callable[[], Any], path: Path) -> Dict[str, Dict[str, float]]:
    """torch.profiler over run(): its table to path; aten op -> calls and self ms, the most time first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    averages = prof.key_averages()
    path.write_text(averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    rows = {e.key: {"calls": e.count, "self_ms": e.self_cpu_time_total / 1e3} for e in averages}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["self_ms"]))


def _by_part(forwards: List[Dict[str, float]], periods: List[float]) -> Dict[str, float]:
    """ms a step by part (means over the steps), the step (their sum) and the driver's period (wall, median)."""
    parts = sorted({k for f in forwards for k in f} - {"forward_batch"})
    out = {p: statistics.fmean(f.get(p, 0.0) for f in forwards) * 1e3 for p in parts}
    out["step"] = sum(out.values())
    out["period (wall, median)"] = statistics.median(periods) * 1e3
    return out


def cpu_parts(model: Any, out: Path, repeats: int = 5, threads: int | None = None,
              prefills: Sequence[int] | None = None, decode_bs: Sequence[int] | None = None,
              ops: str = "auto") -> Dict[str, Any]:
    """The steps of PREFILLS and DECODE_BS (or those given) on a fresh engine with the ops backend `ops`; writes
    out/summary.json."""
    prefills, decode_bs = prefills or PREFILLS, decode_bs or DECODE_BS
    ref = as_model(model)
    seq = max(*prefills, CTX + STEPS + 8) + 64
    engine = Engine(EngineConfig(model_path=str(ref.folder), tp_info=DistributedInfo(0, 1), dtype=torch.float32,
                                 device="cpu", max_running_req=max(decode_bs), use_dummy_weight=not ref.has_weights,
                                 max_seq_len_override=seq, num_page_override=max(decode_bs) * seq + seq,
                                 ops_backend=ops))
    if threads is not None:
        torch.set_num_threads(threads)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    vocab = engine.config.model_config.vocab_size
    driver = Driver(engine)
    out.mkdir(parents=True, exist_ok=True)
    summary: Dict[str, Any] = {"model": ref.name, "threads": torch.get_num_threads(), "clock": clock.__name__,
                               "ops": engine.config.ops_backend}

    def measure(name: str, run: Callable[[], None], keep: Callable[[Any], bool]) -> None:
        run()  # warm-up
        forwards, periods = [], []
        for _ in range(repeats):
            driver.steps.clear()
            settle()
            with part_timers({"engine": engine, "driver": driver}, clock=clock) as calls:
                run()
            kept = [i for i, s in enumerate(driver.steps) if keep(s)]
            forwards += [calls[i] for i in kept]
            periods += [driver.steps[i].seconds for i in kept]
        summary[name] = {"ms": _by_part(forwards, periods), "steps": len(periods),
                         "aten": _torch_table(run, out / f"torch_{name}.txt")}

    try:
        for n in prefills:
            ids = random_ids(n, vocab, seed=n)
            measure(f"prefill{n}", lambda: driver.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True)),
                    lambda s: s.phase == "prefill")
        for bs in decode_bs:
            prompts = [random_ids(decode_prompt_len(CTX, STEPS), vocab, seed=1000 + i) for i in range(bs)]
            measure(f"decode{bs}", lambda: driver.generate(prompts, SamplingParams(max_tokens=STEPS + 2,
                                                                                    ignore_eos=True)),
                    lambda s, b=bs: s.phase == "decode" and s.batch_size == b)
    finally:
        engine.shutdown()
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def table(summary: Dict[str, Any]) -> str:
    """A markdown table: one column a step kind, ms a step by part."""
    steps = [k for k, v in summary.items() if isinstance(v, dict)]
    parts = list(dict.fromkeys(p for s in steps for p in summary[s]["ms"]))
    lines = ["| ms a step | " + " | ".join(steps) + " |", "|---" * (len(steps) + 1) + "|"]
    for p in parts:
        lines.append(f"| {p} | " + " | ".join(f"{summary[s]['ms'].get(p, 0.0):.2f}" for s in steps) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.bench.cpu_parts", description=__doc__.split("\n\n")[0])
    add_model_arguments(p, "smollm2-135m", many=False)
    p.add_argument("--out", type=Path, default=Path("build/cpu-parts"))
    p.add_argument("--repeats", type=int, default=5, help="runs of each workload (decode: STEPS steps a run)")
    p.add_argument("--threads", type=int, default=None, help="torch's threads after the engine's start (default: "
                   "the engine's own); 1 times by the thread's CPU time")
    p.add_argument("--ops", default="auto", choices=("auto", "torch", "onednn"),
                   help="the engine's ops backend (EngineConfig.ops_backend; auto: onednn on a CPU in fp32)")
    args = p.parse_args(argv)
    model = resolve_model(args, "smollm2-135m", weights=False, tokenizer=False, verb="cpu_parts")
    summary = cpu_parts(model, args.out, args.repeats, args.threads, ops=args.ops)
    print(table(summary))
    print(f"wrote {args.out}/summary.json, torch_*.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
