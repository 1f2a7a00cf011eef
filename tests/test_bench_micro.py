"""CPU micro-benchmarks (pytest-benchmark): one decode step and one prefill through the driver.

`nox -s bench` saves them to build/reports/bench/cpu/pytest-benchmark.json (`nox -s bench -- --update-reports`: to
the committed reports/bench/cpu/pytest-benchmark.json); compare a change against it with
`pytest tests/test_bench_micro.py --benchmark-only --benchmark-compare=<saved json>`.
"""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig
from engine.core import Batch, Req, SamplingParams
from engine.distributed import DistributedInfo
from harness import zoo
from harness.driver import Driver


@pytest.fixture(scope="module", params=["tiny-qwen3", "smollm2-135m"])
def driver(request):
    eng = Engine(EngineConfig(model_path=str(zoo.path(request.param)), tp_info=DistributedInfo(0, 1),
                              dtype=torch.float32, device="cpu", num_page_override=4096, max_seq_len_override=1024,
                              max_running_req=8))
    yield Driver(eng)
    eng.shutdown()


@pytest.mark.parametrize("bs", [1, 4])
def test_decode_step(benchmark, driver, bs):
    """One decode step at context 128, as the spec drives the engine: batch fields, attention metadata, sampler
    preparation, forward, sampling, the copy back."""
    eng = driver.engine
    reqs = []
    for row in range(bs):
        eng.page_table[row, :256] = torch.arange(row * 256, row * 256 + 256)
        reqs.append(Req(torch.arange(1, 130, dtype=torch.int32), row, 128, 64, row, SamplingParams(), None))

    def step() -> None:
        for r in reqs:  # the same position again: the step's cost, without the request growing
            r.cached_len, r.device_len = 128, 129
        batch = Batch(reqs=reqs, phase="decode")
        eng.graph_runner.pad_batch(batch)
        batch.positions = torch.full((bs,), 128, dtype=torch.int32)
        batch.input_ids = torch.full((bs,), 7, dtype=torch.int32)
        batch.out_loc = eng.page_table[torch.arange(bs), 128].long()
        eng.attn_backend.prepare_metadata(batch)
        out = eng.forward_batch(batch, eng.sampler.prepare(batch))
        out.copy_done_event.synchronize()

    benchmark.pedantic(step, rounds=10, warmup_rounds=2)


def test_prefill_128(benchmark, driver):
    prompt = list(range(1, 129))
    benchmark.pedantic(lambda: driver.generate([prompt], SamplingParams(max_tokens=1)), rounds=5, warmup_rounds=1)
