"""The driver's step budget (harness.step_budget): its arithmetic, its FLOP counts against the bench's, and its
decisions in the long-prompt scenario scaled to the CPU: SmolLM2, 32 running requests, a 4k-token prompt arriving.

The scenario's measure is the issue's, taken in the cost model the policy decides by (the decisions, not a timing):
the running requests' inter-token latency while the prompt arrives, each gap the predicted cost of the steps between
two of their tokens, against their step without it (the same decodes alone), and the prompt's time to first token
against its own alone. A step at most STALL times its decodes keeps the first within STALL; the second is then at
least STALL / (STALL - 1) of the prompt's work (harness.step_budget), met here within the rounding of integer chunks
and their own rows of logits. Planted faults (tests/scheduler_faults.py) must be found by the same checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Engine, EngineConfig
from engine.core import SamplingParams
from engine.distributed import DistributedInfo
from harness import zoo
from harness.bench.workloads import chunk_steps, random_ids
from harness.driver import Driver, StepView
from harness.step_budget import StepBudget, StepCost, pairs
from scheduler_faults import PATCHES, planted_driver

STALL = 3.0
ROUNDING = 1.02  # integer chunks (each up to a token under its allowance) and each chunk's own row of logits


@settings(max_examples=300, deadline=None)
@given(per_token=st.floats(1e-6, 1.0), per_row=st.floats(0.0, 1.0), per_pair=st.floats(0.0, 1e-2),
       per_key=st.one_of(st.just(0.0), st.floats(0.0, 1.0)), allowance=st.floats(0.0, 1e4),
       cached=st.integers(0, 40000), most=st.integers(1, 8192))
def test_a_chunk_is_the_longest_that_fits_its_allowance(per_token, per_row, per_pair, per_key, allowance, cached,
                                                         most):
    """The longest chunk within the allowance, its prefix's keys (no chunk of it avoids them) beside it."""
    budget = StepBudget(StepCost(0.0, per_token, per_row, per_pair, per_key), stall=2.0)
    n = budget.chunk(allowance, cached, most)
    allowance += per_key * cached
    assert 1 <= n <= most
    assert n == 1 or budget.cost.variable(n, cached) <= allowance
    assert n == most or budget.cost.variable(n + 1, cached) > allowance


# qwen3-0.6b's steps on an H100, fitted (reports/bench/cuda/qwen3-0.6b/long-prompt.json): 11.5 ms of keys' floor at 32k
H100_FIT = StepCost(fixed=1.63e-3, per_token=0.0, per_row=2.78e-6, per_pair=1.50e-10, per_key=3.51e-7)


@pytest.mark.parametrize("stall", [2.0, 3.0])
def test_a_deep_prompt_takes_the_allowance_beside_its_keys_floor(stall):
    """The 32k prompt beside 32 decodes of 512 tokens, over the H100's fitted cost: every step within stall times its
    decodes plus its chunk's keys' floor (the most any chunk of it can do), and no run of few-token chunks where the
    floor nears the allowance (charged to it, the floor left 36 steps of about 7 tokens on the card)."""
    budget = StepBudget(H100_FIT, stall=stall)
    decodes, allowance = H100_FIT.decodes(32, 32 * 512), budget.allowance(32, 32 * 512)
    depth, chunks = 0, []
    while depth < 32768:
        n = min(budget.chunk(allowance, depth, 4096 - 32), 32768 - depth)
        assert decodes + H100_FIT.variable(n, depth) <= stall * decodes + H100_FIT.per_key * depth + 1e-12
        chunks.append(n)
        depth += n
    assert min(chunks[:-1]) >= 300, chunks
    assert len(chunks) <= 60


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-moe", "smollm2-135m"])
def test_the_token_budget_weighs_as_the_bench_counts_flops(model):
    """StepCost.from_config's ratios (a pair, a row of logits, to a token) are the bench's FLOP counts'
    (harness.bench.limits.model_cost, counted from the built model's parameters)."""
    from harness.bench.limits import model_cost

    eng = Engine(EngineConfig(model_path=str(zoo.path(model)), tp_info=DistributedInfo(0, 1), dtype=torch.float32,
                              device="cpu", num_page_override=64, max_seq_len_override=64))
    try:
        counted, cost = model_cost(eng), StepCost.from_config(eng.config.model_config)
    finally:
        eng.shutdown()
    assert cost.per_pair == pytest.approx(counted.attn_flops_per_pair / counted.flops_per_token, rel=1e-2)
    assert cost.per_row == pytest.approx(counted.head_flops_per_row / counted.flops_per_token, rel=1e-2)


# ------------------------------------------------------------------------------------------------ the scenario
def arriving(driver: Driver, running: int, ctx: int, long_len: int, vocab: int) -> List[StepView]:
    """running requests of ctx-token prompts, then a long_len-token prompt behind them (admitted once they are
    prefilled); they decode through its arrival (as the budget takes it) and 4 steps more. Every step's view."""
    views: List[StepView] = []
    shorts = [random_ids(ctx, vocab, seed=3000 + i) for i in range(running)]
    steps = chunk_steps(driver, running, ctx, long_len) + 4
    params = [SamplingParams(max_tokens=steps, ignore_eos=True)] * running
    driver.generate(shorts + [random_ids(long_len, vocab, seed=long_len)],
                    params + [SamplingParams(max_tokens=1, ignore_eos=True)], on_step=views.append)
    return views


def _cost(spans: List[Tuple[int, int, int]], cost: StepCost) -> float:
    return cost(sum(n for _, _, n in spans), len(spans), sum(pairs(n, s) for _, s, n in spans))


def judge(views: List[StepView], cost: StepCost, running: int, long_uid: int, budget: int) -> Dict[str, object]:
    """The scenario's measures in the cost model, and what breaks the policy's promises: steps during the prompt's
    arrival that leave a running request out, or cost more than STALL times their decodes alone. budget: the prefill
    budget the prompt alone is chunked at."""
    long_steps = [i for i, v in enumerate(views) if any(u == long_uid for u, _, _ in v.spans)]
    first, last = long_steps[0], long_steps[-1]
    faults, ratios, since = [], [], 0.0
    for i in range(first, len(views)):  # through the first step that decodes them all after the prompt's last
        spans = views[i].spans
        decodes = [(u, s, n) for u, s, n in spans if u != long_uid]
        since += _cost(spans, cost)
        if len(decodes) != running:
            faults.append(f"step {i}: {len(decodes)} of {running} running requests decoded")
            continue
        alone = _cost(decodes, cost)
        if _cost(spans, cost) > STALL * alone:
            faults.append(f"step {i}: {_cost(spans, cost) / alone:.2f}x its decodes alone")
        ratios.append(since / alone)
        since = 0.0
        if i > last:
            break
    chunks = [n for i in long_steps for u, s, n in views[i].spans if u == long_uid]
    unloaded = sum(cost(c, 1, pairs(c, d)) for d, c in _whole(sum(chunks), budget))
    loaded = sum(_cost(views[i].spans, cost) for i in range(first, last + 1))
    return {"faults": faults, "itl_ratio": max(ratios), "ttft_ratio": loaded / unloaded, "chunks": chunks}


def _whole(length: int, budget: int) -> List[Tuple[int, int]]:
    """(depth, tokens) of a prompt prefilled alone: chunks of the prefill budget."""
    return [(d, min(budget, length - d)) for d in range(0, length, budget)]


@pytest.fixture  # one engine a process: gone before the next test builds its own
def smollm2() -> Engine:
    eng = Engine(EngineConfig(model_path=str(zoo.path("smollm2-135m")), tp_info=DistributedInfo(0, 1),
                              dtype=torch.float32, device="cpu", max_running_req=33, max_seq_len_override=4096 + 64,
                              num_page_override=4096 + 33 * 192))
    yield eng
    eng.shutdown()


def test_a_4k_prompt_arriving_beside_32_running_requests(smollm2):
    """SmolLM2 on the CPU, the stall budget over its FLOP counts: every step of the prompt's arrival decodes all 32
    requests and costs at most 3x their decodes alone, so their inter-token latency stays within 3x their step
    without it; the prompt's chunks shrink as its prefix deepens; its time to first token within 1.5x of its own
    alone, to the rounding of its integer chunks."""
    cost = StepCost.from_config(smollm2.config.model_config)
    driver = Driver(smollm2, step_budget=StepBudget(cost, stall=STALL))
    views = arriving(driver, 32, 32, 4096, smollm2.config.model_config.vocab_size)
    got = judge(views, cost, 32, 32, driver.max_prefill_tokens)
    assert got["faults"] == [], got["faults"][:5]
    assert got["itl_ratio"] <= STALL
    assert got["ttft_ratio"] <= STALL / (STALL - 1) * ROUNDING, got["ttft_ratio"]
    chunks = got["chunks"]
    assert sum(chunks) == 4096 and chunks[0] >= 1.5 * min(chunks[:-1]), chunks


@pytest.fixture(scope="module")
def tiny() -> Engine:
    eng = Engine(EngineConfig(model_path=str(zoo.path("tiny-qwen3")), tp_info=DistributedInfo(0, 1),
                              dtype=torch.float32, device="cpu", max_running_req=9, max_seq_len_override=1024 + 64,
                              num_page_override=4096))
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("fault", [None, *PATCHES])
def test_the_checks_find_each_planted_scheduler_fault(tiny, fault, tmp_path: Path):
    """The same scenario, smaller (tiny-qwen3, 8 running, a 1k prompt): the driver passes; a chunk that ignores the
    budget and decodes starved for a step are each named."""
    cost = StepCost.from_config(tiny.config.model_config)
    cls = Driver if fault is None else planted_driver(fault, tmp_path)
    driver = cls(tiny, step_budget=StepBudget(cost, stall=STALL))
    got = judge(arriving(driver, 8, 32, 1024, tiny.config.model_config.vocab_size), cost, 8, 8,
                driver.max_prefill_tokens)
    if fault is None:
        assert got["faults"] == [] and got["itl_ratio"] <= STALL
    elif fault == "chunk-ignores-budget":
        assert got["faults"] and all("x its decodes alone" in f for f in got["faults"]), got["faults"]
        assert got["itl_ratio"] > STALL
    else:
        assert any("of 8 running requests decoded" in f for f in got["faults"]), got["faults"]
        assert got["itl_ratio"] > STALL
