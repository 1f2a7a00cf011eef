"""Chunked prefill: a prompt longer than the prefill budget is prefilled in chunks over its own cached prefix.

Against one whole prefill: every prompt and decode position's log-probabilities within parity's tolerance (not
bitwise: a chunk's attention and GEMMs run over other shapes, which sum in another order) and the same greedy tokens,
at any budget (1-token chunks, budgets that do not divide the prompt). The loops and (on CUDA) graphs against eager
stay bitwise equal with chunks; running requests decode between a long prompt's chunks.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Dict, List, Tuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine import Engine, EngineConfig
from engine.core import SamplingParams
from engine.distributed import DistributedInfo
from harness import golden as G
from harness import zoo
from harness.driver import Driver, StepView
from harness.parity.gate import tolerance
from harness.step_budget import StepBudget, StepCost

MODEL = "tiny-qwen3"
STEPS = 6  # decode positions compared after each prompt
GREEDY = SamplingParams(max_tokens=STEPS, ignore_eos=True)


def prompt(n: int, seed: int = 0) -> List[int]:
    return np.random.default_rng(seed * 1000 + n).integers(10, 4000, n).tolist()


def make_engine(device: str = "cpu", **kw) -> Engine:
    kw = dict(dict(dtype=torch.float32, page_size=4, max_running_req=4, num_page_override=256,
                   max_seq_len_override=256), **kw)
    return Engine(EngineConfig(model_path=str(zoo.path(MODEL)), tp_info=DistributedInfo(0, 1), device=device, **kw))


class Engines:
    """One live engine at a time (a process holds one): asking for another configuration shuts the live one down."""

    def __init__(self) -> None:
        self.live: Engine | None = None
        self.kw: dict | None = None

    def get(self, **kw) -> Engine:
        if self.live is None or kw != self.kw:
            self.close()
            self.live, self.kw = make_engine(**kw), kw
        return self.live

    def close(self) -> None:
        if self.live is not None:
            self.live.shutdown()
            self.live = None


@pytest.fixture(scope="module")
def engines():
    pool = Engines()
    yield pool
    pool.close()


@pytest.fixture
def engine(engines: Engines) -> Engine:
    return engines.get()


def run(engine: Engine, prompts: List[List[int]], budget: int, params: SamplingParams = GREEDY,
        forced: List[List[int]] | None = None, **kw) -> Tuple[List[List[int]], Dict[Tuple[int, int], torch.Tensor]]:
    """(tokens per request, log-probabilities by (uid, position)) of every prompt and decode position; kw: the
    driver's."""
    seen: Dict[Tuple[int, int], torch.Tensor] = {}

    def hook(uid: int, pos: int, lp: torch.Tensor) -> None:
        for i in range(lp.shape[0]):
            assert (uid, pos + i) not in seen, "a position handed over twice"
            seen[(uid, pos + i)] = lp[i].float().cpu()

    results = Driver(engine, max_prefill_tokens=budget, **kw).generate(prompts, params, forced=forced, on_logits=hook)
    return [r.output_ids for r in results], seen


def max_err(ref: Dict, got: Dict, k: int = 16) -> float:
    """Parity's measure: max |log-probability difference| on the reference's top-k ids, at every position."""
    assert ref.keys() == got.keys()
    return max((ref[p].gather(0, ids) - got[p].gather(0, ids)).abs().max().item()
               for p in ref for ids in [ref[p].topk(k).indices])


@pytest.fixture(scope="module")
def tol() -> float:
    return tolerance(G.load_checked(MODEL, "cpu", "float32"), "float32")


_WHOLE: Dict[int, tuple] = {}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(length=st.integers(2, 80), budget=st.integers(1, 40))
@example(length=37, budget=1)  # 1-token chunks
@example(length=80, budget=7)  # a budget that does not divide the prompt
@example(length=64, budget=16)  # one that does
def test_chunks_match_one_whole_prefill(engine, tol, length, budget):
    if length not in _WHOLE:
        _WHOLE[length] = run(engine, [prompt(length)], budget=4096)
    tokens, lp = run(engine, [prompt(length)], budget=budget)
    whole_tokens, whole_lp = _WHOLE[length]
    assert len(lp) == length + STEPS - 1  # every prompt position once, each chunk's rows included
    assert max_err(whole_lp, lp) <= tol
    assert tokens == whole_tokens


def test_a_prompt_over_the_engines_forward_budget_is_served(engines):
    """max_prefill_tokens=16 on the engine: its reserve is sized for 16-token forwards; a 100-token prompt is
    prefilled in chunks of 16 (the driver's budget is capped at the engine's), with the tokens of one whole
    prefill."""
    small = engines.get(max_prefill_tokens=16)
    assert small.config.max_forward_len == 16
    chunks: List[int] = []
    driver = Driver(small)
    assert driver.max_prefill_tokens == 16
    out = driver.generate([prompt(100)], GREEDY,
                          on_step=lambda v: chunks.append(v.spans[0][2]) if v.phase == "prefill" else None)
    assert chunks == [16] * 6 + [4]
    assert out[0].output_ids == Driver(engines.get()).generate([prompt(100)], GREEDY)[0].output_ids


def test_the_memory_probe_prefills_the_deepest_chunk(engines):
    """The reserve's prefill probe (measured on CUDA) is a forward of max_forward_len tokens over a cached prefix
    that ends it at max_seq_len: the deepest chunk a prompt has, where attention reads the most keys."""
    from engine.memory import run_model_probes, scratch_context

    eng = engines.get(max_prefill_tokens=16)
    seen: List[tuple] = []

    def backend():
        b = eng._make_attn_backend(eng.config)
        plan = b.prepare_metadata
        b.prepare_metadata = lambda batch: (seen.append((batch.phase, [(r.cached_len, r.extend_len)
                                                                        for r in batch.reqs])), plan(batch))
        return b

    with torch.inference_mode(), scratch_context(eng.config, lambda pages: eng._make_kv_pool(eng.config, pages),
                                                 backend, lambda: eng._make_moe_backend(eng.config)) as max_bs:
        run_model_probes(eng.model, eng.config, max_bs)
    assert seen[0] == ("prefill", [(256 - 16, 16)])


def test_nothing_is_sampled_before_the_last_chunk(engine):
    """With each prompt's last position only (prompt_logits=False), a chunk's rows are not handed over, and each
    request's first token is the one sampled after its last chunk."""
    positions: List[Tuple[int, int]] = []
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=7)
    out = Driver(engine, max_prefill_tokens=8, prompt_logits=False).generate(
        [prompt(30)], params, on_logits=lambda uid, pos, lp: positions.extend((uid, pos + i) for i in range(len(lp))))
    assert positions == [(0, 29), (0, 30), (0, 31)]
    assert out[0].output_ids == Driver(engine).generate([prompt(30)], params)[0].output_ids


def _arriving(engine: Engine, overlap: bool, **kw) -> List[Tuple[str, tuple]]:
    """Two requests decode while a 90-token prompt arrives at a budget of 32: every step's (phase, spans)."""
    views: List[Tuple[str, tuple]] = []
    prompts = [prompt(5, 1), prompt(6, 2), prompt(90, 3)]
    params = [SamplingParams(max_tokens=20, ignore_eos=True)] * 2 + [SamplingParams(max_tokens=2, ignore_eos=True)]

    def on_step(view: StepView) -> None:
        views.append((view.phase, tuple(view.spans)))
        live = {r.uid: r for r in view.live}
        if 2 in live:  # the long request holds the pages of its whole request from its first chunk
            assert len(live[2].pages) == -(-(90 + 2) // 4)

    Driver(engine, max_prefill_tokens=32, decode_chunk_tokens=8, overlap=overlap, **kw).generate(
        prompts, params, on_step=on_step)
    assert views[0] == ("prefill", ((0, 0, 5), (1, 0, 6)))  # the long one waits: over the rest of the budget
    return views


@pytest.mark.parametrize("overlap", [True, False])
def test_running_requests_decode_in_every_step_a_chunk_takes(engine, overlap):
    """Mixed steps: each step decodes both running requests first, then carries a chunk of the long prompt whose
    cost fits the token budget (8 tokens at depth 0 in the model's FLOPs): 8 tokens first, fewer as the prefix
    deepens, every chunk the longest that fits."""
    views = _arriving(engine, overlap)
    budget = StepBudget(StepCost.from_config(engine.config.model_config), tokens=8)
    chunks = [spans for phase, spans in views if any(u == 2 and s < 90 for u, s, _ in spans)]
    for spans in chunks:
        assert spans[:2] == ((0, spans[0][1], 1), (1, spans[1][1], 1))  # the decodes lead
        (_, start, n), = spans[2:]
        assert budget.cost.variable(n, start) <= budget.allowance(2, 0)
        assert start + n == 90 or budget.cost.variable(n + 1, start) > budget.allowance(2, 0)
    starts = [spans[2][1] for spans in chunks]
    sizes = [spans[2][2] for spans in chunks]
    assert starts[0] == 0 and sizes[0] == 8 and sum(sizes) == 90
    assert sizes[:-1] == sorted(sizes[:-1], reverse=True) and sizes[-2] < 8  # deeper, fewer
    assert all(phase == "prefill" for phase, _ in views[: len(chunks) + 1])  # no step without the prompt's chunk


@pytest.mark.parametrize("overlap", [True, False])
def test_alternating_steps_decode_between_chunks(engine, overlap):
    """mixed=False: chunks of at most 8 while they decode, every chunk step followed by a decode step of both,
    until the prompt's last chunk."""
    views = _arriving(engine, overlap, mixed=False)
    assert views[1] == ("prefill", ((2, 0, 8),))  # its first chunk leads the next step, capped: the others decode
    chunks = [i for i, (phase, spans) in enumerate(views) if phase == "prefill" and any(u == 2 for u, _, _ in spans)]
    starts = [next(s for u, s, _ in views[i][1] if u == 2) for i in chunks]
    assert starts == list(range(0, 90, 8))  # chunks of 8 (the last of 2)
    for i in chunks[:-1]:  # between two chunks: one decode step of both running requests
        phase, spans = views[i + 1]
        assert phase == "decode" and {u for u, _, _ in spans} == {0, 1}
        assert views[i + 2][0] == "prefill"


def test_the_loops_agree_bitwise_with_chunks(engine):
    """Overlap against the simple loop with chunks and decodes interleaved, sampled and greedy requests: the same
    tokens and bitwise the same log-probabilities."""
    prompts = [prompt(7, 4), prompt(61, 5), prompt(3, 6), prompt(45, 7)]
    params = [SamplingParams(max_tokens=9, temperature=0.8, top_k=20, seed=3),
              SamplingParams(max_tokens=5, ignore_eos=True), SamplingParams(max_tokens=12, temperature=1.0),
              SamplingParams(max_tokens=4, ignore_eos=True)]
    a_tokens, a_lp = run(engine, prompts, 16, params, overlap=True, decode_chunk_tokens=5)
    b_tokens, b_lp = run(engine, prompts, 16, params, overlap=False, decode_chunk_tokens=5)
    assert a_tokens == b_tokens
    assert a_lp.keys() == b_lp.keys() and all(torch.equal(a_lp[p], b_lp[p]) for p in a_lp)


def test_admission_waits_for_the_pages_of_the_whole_request_and_says_so(engines, caplog):
    """A pool of 40 slots: a 30-token prompt waits for the 16-token request to finish before its first chunk."""
    eng = engines.get(num_page_override=10)
    views: List[Tuple[str, set]] = []
    with caplog.at_level(logging.INFO, logger="harness.driver"):
        out = Driver(eng, max_prefill_tokens=8).generate(
            [prompt(12, 8), prompt(30, 9)], SamplingParams(max_tokens=4, ignore_eos=True),
            on_step=lambda v: views.append((v.phase, {u for u, _, _ in v.spans})))
    assert "request 1 waits for 9 KV pages (6 free)" in caplog.text
    first_chunk = views.index(("prefill", {1}))
    assert all(0 not in uids for _, uids in views[first_chunk:])  # request 0 was done by then
    assert [len(r.output_ids) for r in out] == [4, 4]


@pytest.mark.parametrize("budget,overlap", [(1, True), (5, False)])
def test_every_fuzz_invariant_holds_with_chunks(engines, budget, overlap):
    """The fuzzer's invariants on one case of long prompts against a small budget: pool checks after every step,
    K/V and logits against each request alone, overlap against the simple loop and a repeat bitwise, with
    sampled and greedy requests, a cached prefix and an EOS stop."""
    from harness.fuzz.case import FuzzConfig, RequestSpec, Workload
    from harness.fuzz.invariants import Evaluator

    engines.close()  # the evaluator builds its own engine in this process
    requests = (RequestSpec(tuple(prompt(37, 10)), 6, temperature=0.9, seed=4),
                RequestSpec(tuple(prompt(3, 11)), 12, ignore_eos=True),
                RequestSpec(tuple(prompt(29, 12)), 5, prefix_len=11),
                RequestSpec(tuple(prompt(40, 13)), 4, top_k=5, temperature=1.0))
    config = FuzzConfig(dtype="float32", attention_backend="torch", graphs=False, slots=3, page_size=4,
                        pool_tokens=128, max_prefill_tokens=budget, overlap=overlap)
    evaluator = Evaluator(MODEL, "cpu")
    try:
        assert evaluator.evaluate(config, Workload(requests, eos=((1, 5),))) is None
        assert evaluator.counts["positions compared bitwise"] > 0 and evaluator.counts["pool steps"] > 0
    finally:
        evaluator.close()


def test_the_bench_times_long_prompts_and_the_decodes_beside_their_chunks(engines):
    """harness.bench.long_context at CPU sizes: a time to first token of a chunked prompt with its floor; the running
    requests' inter-token latencies alone and while the prompt arrives (a gap each a chunk takes), its time to first
    token beside them and alone, and the two targets."""
    from harness.bench.limits import Limits
    from harness.bench.long_context import bench_long, long_context_targets
    from harness.bench.run import _row
    from harness.bench.workloads import SPECS

    engines.close()  # the bench builds its own engine
    spec = dataclasses.replace(SPECS["cpu"], long_prompts=(96,), itl=(3, 16, 96), long_budget=16, repeats=1)
    rows = {r["workload"]: r for r in bench_long(MODEL, "cpu", "float32", spec, Limits(1e10, 1e11), _row)}
    assert rows["ttft_long"]["length"] == 96 and 0 < rows["ttft_long"]["fraction_of_floor"]
    # mixed steps: chunks of 13 tokens (the step's 16 less the 3 decodes), a gap each for each running request
    assert rows["itl_arriving"]["samples"] >= 3 * -(-96 // 13)
    assert rows["itl"]["samples"] >= 3 * 16  # their steps alone, as many as the arrival takes and 16 more
    assert rows["ttft_arriving"]["median_s"] > 0 and rows["ttft_alone"]["median_s"] > 0
    targets = long_context_targets(list(rows.values()), MODEL)
    assert [t["target"].split(" ")[0] for t in targets] == ["time", "p99", "that"]


# ------------------------------------------------------------------------------------------------ CUDA (H200)
def _cuda_engine(**kw) -> Engine:
    return make_engine("cuda", **dict(dict(dtype=torch.bfloat16, page_size=16, max_running_req=8,
                                           num_page_override=512, max_seq_len_override=4096), **kw))


@pytest.mark.cuda
def test_cuda_chunks_match_one_whole_prefill(engines):
    """bf16 on FlashInfer with prefill graphs: a 3000-token prompt in chunks of 512 and of 100 (not dividing it),
    teacher-forced, against one whole prefill: every position within parity's bf16 tolerance, and the same argmax
    wherever the whole prefill's top two are further apart than twice the position's error."""
    engines.close()  # a CPU test's engine, when the whole file runs on a GPU machine
    eng = _cuda_engine()
    try:
        tol = tolerance(G.load_checked(MODEL, "cuda", "bfloat16"), "bfloat16")
        forced = [[(7 * j) % 1000 + 10 for j in range(STEPS)]]
        whole = run(eng, [prompt(3000)], 4096, forced=forced)[1]
        for budget in (512, 100):
            got = run(eng, [prompt(3000)], budget, forced=forced)[1]
            assert max_err(whole, got) <= tol
            for p, ref in whole.items():
                top = ref.topk(2).values
                err = (ref - got[p]).abs().max().item()
                assert top[0] - top[1] <= 2 * err or got[p].argmax() == ref.argmax(), p
    finally:
        eng.shutdown()


@pytest.mark.cuda
def test_cuda_graphs_equal_eager_and_overlap_equals_simple_with_chunks(engines):
    prompts = [prompt(9, 1), prompt(1500, 2), prompt(40, 3)]
    params = [SamplingParams(max_tokens=30, temperature=0.9, seed=5), SamplingParams(max_tokens=3, ignore_eos=True),
              SamplingParams(max_tokens=20, ignore_eos=True)]
    outs = []
    engines.close()
    for graphs in (True, False):
        eng = _cuda_engine(cuda_graph_max_bs=None if graphs else 0, prefill_graph_tokens=None if graphs else 0)
        try:
            for overlap in (True, False):
                outs.append(run(eng, prompts, 256, params, overlap=overlap, decode_chunk_tokens=128))
        finally:
            eng.shutdown()
    for tokens, lp in outs[1:]:
        assert tokens == outs[0][0] and all(torch.equal(lp[p], outs[0][1][p]) for p in outs[0][1])


@pytest.mark.cuda
def test_cuda_reserve_follows_the_prefill_budget(engines):
    """An engine whose forward budget is 512 reserves activations for 512-token forwards at the deepest prefix, less
    than one sized for 4096 tokens, and serves a 4000-token prompt in chunks."""
    engines.close()
    small = _cuda_engine(max_prefill_tokens=512, num_page_override=None)
    try:
        assert small.config.max_forward_len == 512
        small_reserve = small.reserve.activations
        out = Driver(small).generate([prompt(4000)], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(out[0].output_ids) == 2
    finally:
        small.shutdown()
    big = _cuda_engine(max_prefill_tokens=4096, num_page_override=None)
    try:
        assert small_reserve < big.reserve.activations
    finally:
        big.shutdown()
