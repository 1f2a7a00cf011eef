"""The bench's workloads measure what their rows say: the decode steps they time attend over the stated context on
average (prompts of the context itself averaged context + steps / 2) and are all of the stated batch size, in the
bench and in the A/B runner (`--against`) alike; the decode graph's profiled replay is a step at that context; and a
timed run does not pay for the garbage of what ran before it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from engine import Engine, EngineConfig
from engine.core import SamplingParams
from engine.distributed import DistributedInfo
from harness import zoo
from harness.bench import ab_runner
from harness.bench.workloads import decode_at, engine_decode, engine_offline, engine_prefill, engine_ttft
from harness.driver import Driver


def _engine() -> Engine:
    zoo.prepare("tiny-qwen3")
    return Engine(EngineConfig(model_path=str(zoo.path("tiny-qwen3")), tp_info=DistributedInfo(0, 1),
                               dtype=torch.float32, device="cpu", num_page_override=1024, max_seq_len_override=256,
                               max_running_req=4))


@pytest.mark.parametrize("bs,ctx,steps", [(1, 64, 8), (3, 100, 9), (2, 33, 32)])
def test_decode_steps_average_the_stated_context(bs, ctx, steps):
    eng = _engine()
    try:
        records = engine_decode(Driver(eng), bs, ctx, steps, eng.config.model_config.vocab_size)
    finally:
        eng.shutdown()
    assert len(records) == steps and all(r.phase == "decode" and r.batch_size == bs for r in records)
    mean = sum(r.kv_tokens for r in records) / (bs * steps)
    assert abs(mean - ctx) <= 0.5, mean


@pytest.mark.parametrize("bs,ctx", [(1, 64), (3, 100), (4, 2)])
def test_the_profiled_replay_is_a_step_at_the_stated_context(bs, ctx):
    """decode_at leaves the driver's last step a decode of bs requests over ctx tokens each: the step whose page
    lists and lengths the bs graph's profiled replay reads."""
    eng = _engine()
    try:
        driver = Driver(eng)
        engine_decode(driver, bs, ctx, 8, eng.config.model_config.vocab_size)  # the rows' run, which ends past ctx
        last = decode_at(driver, bs, ctx, eng.config.model_config.vocab_size)
    finally:
        eng.shutdown()
    assert (last.phase, last.batch_size, last.kv_tokens) == ("decode", bs, bs * ctx), last


@pytest.mark.parametrize("bs,ctx,steps", [(1, 64, 8), (2, 33, 32)])
def test_the_ab_runners_decode_steps_average_the_stated_context(bs, ctx, steps):
    eng = _engine()
    try:
        driver = Driver(eng)
        ab_runner._decode(driver, SamplingParams, eng.config.model_config.vocab_size, bs, ctx, steps)
    finally:
        eng.shutdown()
    timed = [r for r in driver.steps if r.phase == "decode" and r.batch_size == bs][1:]  # as _decode takes them
    assert len(timed) == steps
    mean = sum(r.kv_tokens for r in timed) / (bs * steps)
    assert abs(mean - ctx) <= 0.5, mean


def test_the_offline_targets_state_what_sampling_costs():
    """On CUDA the targets put the offline run beside the same requests greedy: the difference is the sampler's."""
    from harness.bench.report import targets

    def row(workload: str, seconds: float) -> dict:
        return {"model": "m", "runner": "engine", "workload": workload, "median_s": seconds,
                "tokens_per_s": 1000 / seconds, "fraction_of_floor": 0.5}

    got = targets({"device": "cuda", "rows": [row("offline", 6.45), row("offline_greedy", 5.75)]})
    line = [t for t in got if "what sampling" in t["target"]]
    assert len(line) == 1 and line[0]["reached"] == "0.70 s of 6.45 s", got


class _Cycle:
    """An object in a reference cycle (as torch.profiler's events are): only a full collection frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.mark.parametrize("workload", ["prefill", "ttft", "decode", "offline"])
def test_a_timed_run_starts_with_the_garbage_before_it_collected(workload):
    """With automatic collection off, a cycle left by what ran before is freed only by the workload's own collection
    (settle): it must be gone when the timed generate starts. Without settle it is alive there."""
    eng = _engine()
    driver, vocab = Driver(eng), eng.config.model_config.vocab_size
    runs = {"prefill": lambda: engine_prefill(driver, 16, vocab, 2), "ttft": lambda: engine_ttft(driver, 16, vocab, 2),
            "decode": lambda: engine_decode(driver, 2, 24, 4, vocab),
            "offline": lambda: engine_offline(driver, [[11] * 8, [12] * 9, [13] * 10], [3, 4, 5])}
    garbage = _Cycle()
    ref = weakref.ref(garbage)
    del garbage
    alive_at_calls = []
    generate = driver.generate

    def recording(*args, **kwargs):
        alive_at_calls.append(ref() is not None)
        return generate(*args, **kwargs)

    driver.generate = recording
    gc.disable()
    try:
        runs[workload]()
    finally:
        gc.enable()
        eng.shutdown()
    assert alive_at_calls and alive_at_calls[-1] is False, alive_at_calls
