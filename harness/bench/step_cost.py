"""The driver's cost model measured (harness.step_budget.StepCost): a least-squares fit, with no coefficient below 0,
of the seconds of real steps through the driver (host work included, overlap on) to what each computes: tokens fed,
requests (rows of logits), attention (query, key) pairs and the keys of a prefill step's deepest request.

The steps cover what the budget decides between: one prompt of `depth` tokens prefilled in chunks of depth / 8 and of
depth / 64 tokens (chunks at every depth up to it), then decoded alone at that depth; `batch` requests of short
prompts decoding together; and the same requests decoding while that prompt is prefilled beside them in the mixed
steps of the driver's own budget (the steps the budget is for). Each workload runs once to warm up, then once
measured; a step's seconds are its period (launch to the next launch), the last step of a run left out (its period
runs to the run's end). The fit's relative residuals say how far the line is from the steps it predicts.

    python -m harness.bench.step_cost --model smollm2-135m --depth 4096 --batch 32
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from typing import List

import numpy as np

from engine.core import SamplingParams
from harness.bench.workloads import chunk_steps, random_ids, settle
from harness.driver import Driver, StepRecord
from harness.step_budget import StepCost


@dataclass
class Fit:
    cost: StepCost
    steps: int
    median_residual: float  # median |predicted - measured| / measured over the steps
    worst_residual: float


def _run(driver: Driver, prompts: List[List[int]], max_tokens: int | List[int]) -> List[StepRecord]:
    params = [SamplingParams(max_tokens=m, ignore_eos=True)
              for m in (max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts))]
    driver.generate(prompts, params)  # warm-up
    driver.steps.clear()
    settle()
    driver.generate(prompts, params)
    return list(driver.steps[:-1])


def measure(driver: Driver, depth: int, batch: int, decode_steps: int = 8) -> Fit:
    """Fit the cost model to the steps of the workloads in the module's docstring (the driver's own engine)."""
    vocab = driver.engine.config.model_config.vocab_size
    long_prompt = random_ids(depth, vocab, seed=depth)
    records: List[StepRecord] = []
    budget = driver.max_prefill_tokens
    try:
        for chunk in sorted({max(16, depth // 8), max(16, depth // 64)}):
            driver.max_prefill_tokens = min(budget, chunk)
            records += _run(driver, [long_prompt], decode_steps)
    finally:
        driver.max_prefill_tokens = budget
    short = [random_ids(32, vocab, seed=7000 + i) for i in range(batch)]
    records += [r for r in _run(driver, short, decode_steps) if r.phase == "decode"]
    if driver.mixed:
        steps = chunk_steps(driver, batch, 32, depth) + decode_steps
        mixed = _run(driver, short + [long_prompt], [steps] * batch + [1])
        records += [r for r in mixed if r.phase == "prefill" and r.decode_rows == batch]
    x = np.array([[1.0, r.num_tokens, r.batch_size, r.pairs, r.deepest] for r in records])
    y = np.array([r.seconds for r in records])
    from scipy.optimize import nnls

    coef, _ = nnls(x / y[:, None], np.ones(len(y)))  # relative errors: short and long steps weigh alike
    rel = np.abs(x @ coef - y) / y
    return Fit(StepCost(*map(float, coef)), len(y), float(statistics.median(rel)), float(rel.max()))


def main(argv: List[str] | None = None) -> int:
    import torch

    from engine import Engine, EngineConfig
    from engine.distributed import DistributedInfo
    from harness import zoo

    p = argparse.ArgumentParser(prog="python -m harness.bench.step_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--depth", type=int, default=4096, help="the longest prompt, prefilled in chunks")
    p.add_argument("--batch", type=int, default=32, help="requests decoding together")
    args = p.parse_args(argv)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    engine = Engine(EngineConfig(
        model_path=str(zoo.path(args.model)), tp_info=DistributedInfo(0, 1), dtype=dtype, device=args.device,
        max_running_req=max(args.batch, 1), use_dummy_weight=not zoo.MODELS[args.model].has_weights,
        max_seq_len_override=args.depth + 64))
    try:
        fit = measure(Driver(engine), args.depth, args.batch)
    finally:
        engine.shutdown()
    print(json.dumps({"model": args.model, "device": args.device, **asdict(fit)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
