"""The bench's workloads measure what their rows say: the decode steps they time attend over the stated context on
average (prompts of the context itself averaged context + steps / 2) and are all of the stated batch size, in the
bench and in the A/B runner (`--against`) alike; the decode graph's profiled replay is a step at that context; and a
timed run does not pay for the garbage of what ran before it; a row the KV pool cannot hold is said, not run."""

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
from harness.bench.workloads import (BenchSpec, decode_at, decode_pages, engine_decode, engine_offline,
                                     engine_prefill, engine_ttft, fit_batches)
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


SMALL = BenchSpec([16], [1, 2, 4], 32, [32, 200], 4, [], [], [4], (4, 8, 16), (2, 8), 1)
POOL = 110  # pages (page size 1): each decode request holds 35 (29-token prompt + 6), so 3 fit at once and 4 do not


def test_a_row_the_kv_pool_cannot_hold_is_a_line_and_every_other_row_is_written(tmp_path, monkeypatch):
    """An engine whose KV pool holds three of the decode rows' requests at once (as qwen3-30b-a3b's pool beside its
    61 GB of weights holds fewer than the 256 of its largest row on an 80 GB card): the bs 4 rows, and the decode
    at a context longer than the pool, are reported with the pages they need and the pool has, not run; bs 3 (the
    most it holds) takes their place; every other row is measured and written."""
    from harness import report
    from harness.bench.limits import measure_limits
    from harness.bench.report import write_bench_report
    from harness.bench.run import bench_model

    per_request = decode_pages(SMALL.decode_ctx, SMALL.decode_steps, 1)
    assert (per_request, fit_batches(SMALL.decode_bs, per_request, POOL)) == (35, ([1, 2, 3], [4]))
    limits = measure_limits(torch.device("cpu"), torch.float32)
    rows, _, _, _, unfit = bench_model("tiny-qwen3", "cpu", SMALL, limits, False, num_page_override=POOL)
    assert [(u["runner"], u["workload"], u["batch_size"], u["length"], u["pages_needed"], u["pages_in_pool"])
            for u in unfit] == [("engine", "decode", 4, 32, 140, POOL), ("engine", "decode_ctx", 1, 200, 203, POOL),
                                ("engine-simple", "decode", 4, 32, 140, POOL)]
    decode = [(r["runner"], r["batch_size"]) for r in rows if r["workload"] == "decode"]
    assert decode == [("engine", 1), ("engine", 2), ("engine", 3), ("engine-simple", 3)], decode
    assert all(r["samples"] > 0 and r["median_s"] > 0 for r in rows), [r for r in rows if not r.get("samples")]
    assert {r["workload"] for r in rows} == {"decode", "decode_ctx", "prefill", "ttft", "offline", "offline_greedy",
                                             "offline_subset", "offline_alternating"}
    monkeypatch.setattr(report, "BUILD_REPORTS_DIR", tmp_path)
    result = {"device": "cpu", "dtype": "float32", "limits": vars(limits), "spec": vars(SMALL), "rows": rows,
              "unfit": unfit}
    printed = write_bench_report(result)
    assert "engine decode bs 4 len 32: not run, its requests need 140 KV pages at once and the pool has 110" in printed
    assert "## Rows the KV pool cannot hold" in (tmp_path / "bench" / "cpu" / "tiny-qwen3" / "summary.md").read_text()
