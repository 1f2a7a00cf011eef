"""One engine in its own process, measured on request: the side of an A/B run (harness.bench.against) and of the
serving gate (harness.bench.serving_gate).

Started with PYTHONPATH (and the working directory) at the tree under test, this revision's or another's, it imports
only that tree's public engine API: engine.Engine and EngineConfig, engine.core.SamplingParams,
engine.distributed.DistributedInfo and harness.driver.Driver; the model comes as a path. So any revision with that API
can be measured, including ones older than the A/B run itself. Requests arrive one JSON object a line on stdin; each
answer is one JSON line on the process's original stdout (whatever else prints goes to stderr). {"op": "serve",
"trace": ...} replays a trace through the side's Driver.serve with this tree's replay (harness/bench/arrivals.py, by
path), for a revision whose driver has serve().

AB_STEP_SLEEP_MS plants a known slowdown: a sleep of that many milliseconds in every forward_batch (how the A/B
statistics are tested).
"""

from __future__ import annotations

import inspect
import json
import os
import random
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Dict, List


def _ids(n: int, vocab: int, seed: int) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


def _decode(driver: Any, params: Any, vocab: int, bs: int, ctx: int, steps: int) -> float:
    """Median period of the decode steps of bs running requests at context ctx (the first one left out): prompts of
    ctx - (steps + 3) // 2 tokens, so that the measured steps, which attend over prompt + 2 ... prompt + steps + 1
    tokens, average ctx (harness.bench.workloads.decode_prompt_len, written out: the runner imports no module of the
    harness but the driver)."""
    prompt = max(1, ctx - (steps + 3) // 2)
    driver.steps.clear()
    driver.generate([_ids(prompt, vocab, 1000 + i) for i in range(bs)], params(max_tokens=steps + 2, ignore_eos=True))
    return statistics.median([s.seconds for s in driver.steps if s.phase == "decode" and s.batch_size == bs][1:])


def _prefill(driver: Any, params: Any, vocab: int, length: int, runs: int) -> float:
    """Median over runs of the prefill step of one request of length tokens, through the driver: the time to its
    first token."""
    out = []
    for _ in range(runs):
        driver.steps.clear()
        driver.generate([_ids(length, vocab, length)], params(max_tokens=1, ignore_eos=True))
        out.append(driver.steps[0].seconds)
    return statistics.median(out)


def _serve(driver: Any, params: Any, trace: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every request's timing as its client saw it (harness.bench.arrivals.Timing, as a dict)."""
    import dataclasses
    import importlib.util
    from pathlib import Path

    name = "serving_gate_arrivals"  # this tree's file under a name of its own: the side's harness is the side's
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("arrivals.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    arrivals = sys.modules[name]
    timings = arrivals.replay(driver, arrivals.Trace.from_json(trace), lambda n: params(max_tokens=n, ignore_eos=True))
    return [dataclasses.asdict(t) for t in timings]


def _engine(setup: Dict[str, Any]) -> Any:
    import torch

    from engine import Engine, EngineConfig
    from engine.distributed import DistributedInfo

    engine = Engine(EngineConfig(
        model_path=setup["model_path"], tp_info=DistributedInfo(0, 1), dtype=getattr(torch, setup["dtype"]),
        device=setup["device"], max_running_req=setup["max_running_req"], use_dummy_weight=setup["dummy_weights"],
        max_seq_len_override=setup["max_seq_len"], num_page_override=setup["num_pages"],
        **{k: setup[k] for k in ("prefill_graph_max_reqs",) if k in setup}))
    sleep = float(os.environ.get("AB_STEP_SLEEP_MS", "0")) / 1e3
    if sleep > 0:
        forward = engine.forward_batch

        def slowed(batch: Any, args: Any) -> Any:
            time.sleep(sleep)
            return forward(batch, args)

        engine.forward_batch = slowed
    return engine


def main() -> int:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints (libraries, progress bars) go to stderr, not into the answers
    sys.stdout = sys.stderr

    def answer(obj: Dict[str, Any]) -> None:
        answers.write(json.dumps(obj) + "\n")

    try:
        import engine as engine_pkg
        from engine.core import SamplingParams
        from harness.driver import Driver

        engine = _engine(json.loads(sys.stdin.readline()))
        # the decode workload's prompts prefilled before they decode together: alternating steps where the driver
        # has the choice (a revision with mixed steps), as every older one steps
        driver = Driver(engine, **({"mixed": False} if "mixed" in inspect.signature(Driver).parameters else {}))
        vocab = engine.config.model_config.vocab_size
        ops: Dict[str, Callable[..., float]] = {
            "decode": lambda bs, ctx, steps: _decode(driver, SamplingParams, vocab, bs, ctx, steps),
            "prefill": lambda length, runs: _prefill(driver, SamplingParams, vocab, length, runs)}
        answer({"ready": True, "engine_file": engine_pkg.__file__, "serves": hasattr(Driver, "serve")})
        for line in sys.stdin:
            request = json.loads(line)
            op = request.pop("op")
            if op == "quit":
                break
            if op == "serve":
                # the revision's driver as it serves by default (mixed steps where it has them)
                answer({"timings": _serve(Driver(engine), SamplingParams, request["trace"])})
                continue
            answer({"seconds": ops[request.pop("workload")](**request)})
        engine.shutdown()
    except Exception:  # the orchestrator shows it, with this process's stderr
        answer({"error": traceback.format_exc()})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
