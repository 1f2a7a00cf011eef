"""The benchmark workloads, run through the engine (via the driver, host work included) and through HF generate."""

from __future__ import annotations

import gc
import random
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Sequence, Tuple

import torch

from engine.core import SamplingParams
from harness.bench.limits import timed
from harness.driver import Driver, StepRecord


@dataclass(frozen=True)
class BenchSpec:
    prefill_lengths: List[int]
    decode_bs: List[int]
    decode_ctx: int
    latency_ctx: List[int]  # decode step latency vs context, at batch 1
    decode_steps: int
    hf_decode_bs: List[int]
    hf_static_bs: List[int]  # HF generate with a static cache, compiled (one compilation per batch size)
    simple_bs: List[int]  # decode through the driver's simple loop too (no overlap), for comparison
    offline: Tuple[int, int, int]  # requests, min length, max length (inputs and outputs alike)
    hf_offline: Tuple[int, int]  # requests of the offline workload HF also runs, output length cap
    repeats: int
    eager: bool = True  # on CUDA also the engine without CUDA graphs (engine-eager)
    # long prompts (harness.bench.long_context), on an engine whose forward budget is long_budget tokens (the
    # driver's default prefill budget): time to first token at these lengths, prefilled in chunks
    long_prompts: Tuple[int, ...] = ()
    # (running requests, their prompt length, an arriving prompt's length): their inter-token latency with and
    # without that prompt arriving
    itl: Tuple[int, int, int] | None = None
    long_budget: int = 4096


SPECS: Dict[str, BenchSpec] = {
    "cpu": BenchSpec([32, 64, 128, 256, 512], [1, 2, 4, 8, 16], 128, [32, 128, 512], 8, [1, 4, 16], [], [1],
                     (32, 32, 128), (8, 32), 5, long_prompts=(256, 512), itl=(4, 32, 512), long_budget=64),
    "cuda": BenchSpec([128, 256, 512, 1024, 2048, 4096], [1, 2, 4, 8, 16, 32, 64, 128, 256], 512,
                      [128, 512, 1024, 2048, 4096], 32, [1, 8, 64, 256], [1], [1, 64, 256],
                      (256, 100, 1024), (32, 64), 5, long_prompts=(8192, 16384, 32768), itl=(32, 512, 32768)),
    # mixture-of-experts shapes (qwen3-30b-a3b, 61 GB): decode at bs 1 / 64 / 256 and prefill, the engine with CUDA
    # graphs only; HF eager only (its static-cache compilation of 48 MoE layers would take longer than the rest of
    # the run)
    "cuda-moe": BenchSpec([512, 2048, 4096], [1, 64, 256], 512, [512, 2048], 32, [1, 64], [], [1, 64, 256],
                          (256, 100, 1024), (32, 64), 3, eager=False),
}


def random_ids(n: int, vocab: int, seed: int) -> List[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n,), generator=g).tolist()


def offline_workload(n: int, lo: int, hi: int) -> Tuple[List[List[int]], List[int]]:
    """nano-vllm's offline workload, draw for draw: random.seed(0), token ids randint(0, 10000), input lengths
    randint(lo, hi), then output lengths randint(lo, hi) (256 x (100, 1024) gives 133,966 output tokens)."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(lo, hi))] for _ in range(n)]
    outputs = [random.randint(lo, hi) for _ in range(n)]
    return prompts, outputs


OFFLINE_PARAMS = dict(temperature=0.6, ignore_eos=True)  # as nano-vllm samples it


def settle() -> None:
    """Collect the process's cyclic garbage before a timed run, so that the run does not pay for what ran before it.
    torch.profiler's events are reference cycles, which only a full collection frees, and the next full collection
    comes when enough has piled up, in whatever runs then: fifteen profiles of 2,550 events each (the bench's decode
    profiles hold 2,550 kernels) left 112,000 unreachable objects, 0.20 s to collect on a 2-core host; after the
    bench's decode and prefill workloads the collection took 0.21-0.24 s on the H200's host."""
    gc.collect()


# ------------------------------------------------------------------------------------------------ engine
def engine_prefill(driver: Driver, length: int, vocab: int, repeats: int) -> List[StepRecord]:
    """The prefill steps of one request of length tokens (its seconds: from scheduling to the token processed)."""
    ids = random_ids(length, vocab, seed=length)
    out = []
    settle()
    for i in range(repeats + 1):
        driver.steps.clear()
        driver.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))
        if i:  # the first is warm-up
            out.append(driver.steps[0])
    return out


def engine_ttft(driver: Driver, length: int, vocab: int, repeats: int) -> List[float]:
    """Time to first token of one request of length tokens: from generate's call to the token on the host
    (admission, the prompt's upload, prefill, sampling, the token's way back); the first call is warm-up."""
    ids = random_ids(length, vocab, seed=length)
    out = []
    settle()
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        driver.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))
        if i:
            out.append(time.perf_counter() - t0)
    return out


def decode_prompt_len(ctx: int, steps: int) -> int:
    """The prompt length that centres a run of steps decode steps on context ctx: the engine's measured steps attend
    over prompt + 2 ... prompt + steps + 1 tokens (its first decode left out), HF's over prompt + 1 ... prompt +
    steps: the engine's average is within half a token of ctx, HF's within one (prompts of ctx averaged ctx +
    (steps + 3) / 2: 529.5 at 512 with 32 steps)."""
    return max(1, ctx - (steps + 3) // 2)


def decode_pages(ctx: int, steps: int, page_size: int) -> int:
    """The KV pages one of engine_decode's requests holds (the driver gives a request pages for its prompt and every
    token it asks for when it admits it)."""
    return -(-(decode_prompt_len(ctx, steps) + steps + 2) // page_size)


def fit_batches(sizes: Sequence[int], per_request: int, pool: int) -> Tuple[List[int], List[int]]:
    """(the batch sizes whose requests the KV pool holds at once, those it cannot). Where some cannot, the largest it
    holds takes their place (rounded down to a multiple of 8 from 8 up: the sizes decode CUDA graphs are captured at),
    so that the curve reaches as far as the pool does."""
    fits, unfit = [b for b in sizes if b * per_request <= pool], [b for b in sizes if b * per_request > pool]
    most = pool // per_request
    most -= most % 8 if most >= 8 else 0
    return fits + ([most] if unfit and most > max(fits, default=0) else []), unfit


@contextmanager
def alternating(driver: Driver) -> Iterator[Driver]:
    """The driver with alternating steps meanwhile: every prompt is prefilled before the requests decode together
    (mixed steps would start the first admitted decoding while the others prefill, and a decode step of all bs would
    come later, fewer and deeper)."""
    mixed, driver.mixed = driver.mixed, False
    try:
        yield driver
    finally:
        driver.mixed = mixed


def engine_decode(driver: Driver, bs: int, ctx: int, steps: int, vocab: int) -> List[StepRecord]:
    """The decode steps of bs requests at context ctx on average, all running (the first decode after a prefill left
    out), with alternating steps."""
    prompts = [random_ids(decode_prompt_len(ctx, steps), vocab, seed=1000 + i) for i in range(bs)]
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    with alternating(driver):
        driver.generate(prompts[:1], SamplingParams(max_tokens=3, ignore_eos=True))  # warm-up
        driver.steps.clear()
        settle()
        driver.generate(prompts, params)
    return [s for s in driver.steps if s.phase == "decode" and s.batch_size == bs][1:]


def decode_at(driver: Driver, bs: int, ctx: int, vocab: int) -> StepRecord:
    """One decode step of bs requests over ctx tokens each, the driver's last: it leaves the bs decode graph's page
    lists and lengths at context ctx, for the graph's replay to be profiled there (engine_decode's steps average ctx;
    its last attends ctx + steps / 2). Returns the step's record."""
    prompts = [random_ids(ctx - 1, vocab, seed=2000 + i) for i in range(bs)]
    with alternating(driver):
        driver.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))  # the prefill's token, then one decode
    return driver.steps[-1]


def chunk_steps(driver: Driver, bs: int, ctx: int, long_len: int) -> int:
    """The steps the driver's budget takes to prefill a long_len-token prompt beside bs requests decoding at about
    ctx tokens (at least: their context grows, and with it a stall budget's allowance)."""
    if not driver.mixed:
        return -(-long_len // min(driver.max_prefill_tokens, driver.decode_chunk_tokens))
    allowance, depth, steps = driver.budget.allowance(bs, bs * ctx), 0, 0
    while depth < long_len:
        depth += driver.budget.chunk(allowance, depth, driver.max_prefill_tokens - bs)
        steps += 1
    return steps


@dataclass
class OfflineRun:
    seconds: float
    output_tokens: int
    steps: List[Any] = field(default_factory=list)


def engine_offline(driver: Driver, prompts: List[List[int]], outputs: List[int], greedy: bool = False) -> OfflineRun:
    """greedy: as HF's side of the comparison runs (do_sample=False); else nano-vllm's temperature 0.6."""
    params = [SamplingParams(max_tokens=o, ignore_eos=True) if greedy else
              SamplingParams(max_tokens=o, **OFFLINE_PARAMS) for o in outputs]
    driver.generate(prompts[:2], params[:2])  # warm-up
    driver.steps.clear()
    settle()
    t0 = time.perf_counter()
    res = driver.generate(prompts, params)
    seconds = time.perf_counter() - t0
    return OfflineRun(seconds, sum(len(r.output_ids) for r in res), list(driver.steps))


# ------------------------------------------------------------------------------------------------ HF
def hf_prefill(model: Any, length: int, vocab: int, repeats: int, device: torch.device) -> List[float]:
    ids = torch.tensor([random_ids(length, vocab, seed=length)], device=device)
    settle()
    with torch.inference_mode():
        return timed(lambda: model(ids, use_cache=False), device, repeats, warmup=1)


class StepTimer:
    """A logits processor HF generate calls once per new token: synchronized timestamps, one step apart."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.stamps = device, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())
        return scores


def _hf_generate(model: Any, ids: torch.Tensor, new: int, mask: torch.Tensor | None = None,
                 timer: StepTimer | None = None, static: bool = False) -> float:
    from transformers import LogitsProcessorList

    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=[], pad_token_id=0)
    if static:  # transformers compiles the forward for a static cache (torch.compile, CUDA graphs)
        kw["cache_implementation"] = "static"
    settle()
    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, logits_processor=LogitsProcessorList([timer] if timer else []), **kw)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def hf_decode(model: Any, bs: int, ctx: int, steps: int, vocab: int, device: torch.device, static: bool = False,
              runs: int = 3) -> Tuple[List[float], float]:
    """Per-step seconds of HF generate, one sample per decode step: the interval between consecutive calls of a
    logits processor that synchronizes (generate itself synchronizes every step to check for finished sequences).
    Returns (samples, warm-up seconds: the first generate, which compiles on the static path)."""
    ids = torch.tensor([random_ids(decode_prompt_len(ctx, steps), vocab, seed=1000 + i) for i in range(bs)],
                       device=device)
    warmup = _hf_generate(model, ids, steps + 1, static=static)
    _hf_generate(model, ids, steps + 1, static=static)  # reduce-overhead mode records its CUDA graphs on a later call
    samples: List[float] = []
    for _ in range(runs):
        timer = StepTimer(device)
        _hf_generate(model, ids, steps + 1, timer=timer, static=static)
        samples += [b - a for a, b in zip(timer.stamps, timer.stamps[1:])]
    return samples, warmup


def hf_offline(model: Any, prompts: List[List[int]], outputs: List[int], device: torch.device,
               batch: int = 64) -> OfflineRun:
    """HF generate over the same requests, left-padded batches; only the tokens each request asked for count."""
    seconds, tokens = 0.0, 0
    for i in range(0, len(prompts), batch):
        ps, outs = prompts[i: i + batch], outputs[i: i + batch]
        width = max(map(len, ps))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=device)
        seconds += _hf_generate(model, ids, max(outs), mask)
        tokens += sum(outs)
    return OfflineRun(seconds, tokens)


def median(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: List[float]) -> Tuple[float, float]:
    """(p10, p90) of the samples."""
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (float("nan"), float("nan"))
    q = statistics.quantiles(xs, n=10)
    return q[0], q[-1]
