"""Batch-invariant mode (EngineConfig.batch_invariant) on the CPU in fp32: a request's log-probabilities at every
position, and its greedy and seeded tokens, are bitwise those of the same request alone, in any batch.

Searched with hypothesis: the compositions (GEMM rows against row counts, positions and threads; the activation
against row counts at 3 threads, where torch's thread chunks cut rows), then random batches on engines with drawn
slots, pages, prefill budgets, chunk sizes, prefix splits, loops and arrival order, against each request alone. The
default mode fails the same comparison (so it is not vacuous); the mode's planted faults are found by the fuzzer.
"""

from __future__ import annotations

import random
from typing import List, Tuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Engine, EngineConfig, batch_invariant
from engine.core import SamplingParams
from engine.distributed import DistributedInfo
from engine.engine import _invariant_backends
from harness import zoo
from harness.bench.invariance import batch_variance, real_prompts
from harness.driver import Driver
from harness.fuzz.faults import planted
from harness.fuzz.invariants import Evaluator
from harness.fuzz.report import failure_text
from harness.fuzz.search import FuzzOptions, fuzz

SHAPES = [(576, 576), (1536, 576), (576, 1536), (512, 256), (256, 512), (192, 576), (49152, 256)]  # the zoo's


class threads:
    def __init__(self, n: int) -> None:
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.before)


# ---------------------------------------------------------------------------------------------- the compositions
@settings(max_examples=60, deadline=None)
@given(shape=st.sampled_from(SHAPES), rows=st.integers(1, 160), span=st.tuples(st.integers(0, 159), st.integers(1, 40)),
       n_threads=st.sampled_from([1, 2, 3, 4]))
def test_gemm_rows_do_not_depend_on_the_row_count(shape, rows, span, n_threads):
    """Any run of rows [a, a + n) computed on its own is bitwise those rows of the whole GEMM."""
    gen = torch.Generator().manual_seed(rows)
    w, x = torch.randn(*shape, generator=gen), torch.randn(rows, shape[1], generator=gen)
    a = span[0] % rows
    b = min(rows, a + span[1])
    with threads(n_threads):
        assert torch.equal(batch_invariant.linear(x[a:b], w), batch_invariant.linear(x, w)[a:b])


@settings(max_examples=30, deadline=None)
@given(inter=st.sampled_from([128, 512, 1536]), rows=st.integers(1, 300), act=st.sampled_from(["silu", "gelu"]))
def test_activation_rows_do_not_depend_on_the_row_count(inter, rows, act):
    """At 3 threads torch's chunks of a flat tensor start mid-row, where the scalar tail rounds exp and tanh unlike
    the vector body: silu(gate) * up of 200 rows of 512 differs from the rows alone. Row blocks do not."""
    gate_up = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows))
    with threads(3):
        whole = batch_invariant.act_and_mul(gate_up, act)
        for i in {0, rows // 2, rows - 1}:
            assert torch.equal(batch_invariant.act_and_mul(gate_up[i: i + 1], act), whole[i: i + 1])


def test_check_gemm_refuses_a_blas_whose_rows_follow_the_row_count(monkeypatch):
    w = torch.randn(512, 256)
    batch_invariant.check_gemm(w)  # this machine's MKL: a row's bits at a fixed M do not follow its place
    # one GEMM of every row, as plain F.linear runs it: MKL's kernel and split follow M
    monkeypatch.setattr(batch_invariant, "linear", lambda x, w, b=None: torch.nn.functional.linear(x, w, b))
    with pytest.raises(RuntimeError, match="computes a GEMM row differently"):
        batch_invariant.check_gemm(w)


def test_the_mode_refuses_what_it_cannot_keep():
    path = str(zoo.prepare("tiny-qwen3"))
    with pytest.raises(ValueError, match="uses the torch kernels"):
        Engine(EngineConfig(model_path=path, tp_info=DistributedInfo(0, 1), dtype=torch.float32, device="cpu",
                            attention_backend="flashinfer", batch_invariant=True))
    config = EngineConfig(model_path=path, tp_info=DistributedInfo(0, 1), dtype=torch.bfloat16, batch_invariant=True)
    with pytest.raises(ValueError, match="runs on the CPU only"):
        _invariant_backends(config, "cuda:0")


# ---------------------------------------------------------------------------------------------- the engine
class Engines:
    """One live engine at a time (a process holds one), rebuilt when the configuration changes."""

    def __init__(self) -> None:
        self.live: Engine | None = None
        self.key: tuple | None = None

    def get(self, model: str, **kw) -> Engine:
        key = (model, tuple(sorted(kw.items())))
        if key != self.key:
            self.close()
            self.live = Engine(EngineConfig(model_path=str(zoo.prepare(model)), tp_info=DistributedInfo(0, 1),
                                            dtype=torch.float32, device="cpu", max_seq_len_override=128,
                                            num_page_override=4096 // kw.get("page_size", 1), **kw))
            self.key = key
        return self.live

    def close(self) -> None:
        if self.live is not None:
            self.live.shutdown()
            self.live = self.key = None


@pytest.fixture(scope="module")
def engines():
    e = Engines()
    yield e
    e.close()


def differences(engine: Engine, prompts, params, prefix_lens=None, **driver) -> Tuple[int, int, List[int]]:
    """(positions whose log-probabilities differ from the request alone, positions, requests whose tokens differ),
    by bench --batch-invariant's measure; every position is computed both in the batch and alone."""
    measured = batch_variance(Driver(engine, **driver), prompts, params, prefix_lens)
    assert measured["positions_unmatched"] == 0, measured
    return measured["positions_differing"], measured["positions"], measured["changed"]


def _params(rng: random.Random) -> SamplingParams:
    if rng.random() < 0.5:
        return SamplingParams(max_tokens=rng.randint(1, 8), ignore_eos=True)
    return SamplingParams(temperature=rng.choice([0.7, 1.0]), top_k=rng.choice([-1, 5]), top_p=rng.choice([1.0, 0.8]),
                          seed=rng.randrange(2 ** 31), max_tokens=rng.randint(1, 8), ignore_eos=True)


@st.composite
def batches(draw):
    rng = random.Random(draw(st.integers(0, 2 ** 32 - 1)))
    n = draw(st.integers(2, 8))
    prompts = [[rng.randrange(10, 40000) for _ in range(rng.randint(1, 60))] for _ in range(n)]
    prefix = [rng.randrange(len(p)) if draw(st.booleans()) else 0 for p in prompts]
    engine = dict(max_running_req=draw(st.sampled_from([2, 8])), page_size=draw(st.sampled_from([1, 4])))
    driver = dict(max_prefill_tokens=draw(st.sampled_from([4096, 16, 5])), overlap=draw(st.booleans()),
                  decode_chunk_tokens=draw(st.sampled_from([1024, 3])))
    return prompts, [_params(rng) for _ in prompts], prefix, engine, driver


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=batches())
def test_a_request_gets_its_alone_logits_and_tokens_in_any_batch(engines, case):
    """Greedy and seeded requests (their draws do not depend on their uid): in the batch bitwise as alone."""
    prompts, params, prefix, engine_kw, driver = case
    engine = engines.get("tiny-qwen3", batch_invariant=True, **engine_kw)
    differ, total, other_tokens = differences(engine, prompts, params, prefix, **driver)
    assert (differ, other_tokens) == (0, []), f"{differ} of {total} positions differ; tokens differ: {other_tokens}"


def test_a_prompt_under_way_keeps_its_own_chunks(engines):
    """Found by the search above: two prompts under way after their prefixes (1 and 5 tokens) at a budget of 16; the
    first's next chunk (16) leaves the step 0 tokens, its last (14) leaves 2, and the second's 5 must wait for a step
    of its own rather than go as 2 + 3 (alone it goes as 5)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 40000) for _ in range(n)] for n in (31, 10)]
    params = [SamplingParams(max_tokens=4, ignore_eos=True)] * 2
    engine = engines.get("tiny-qwen3", batch_invariant=True, max_running_req=8, page_size=1)
    differ, total, other_tokens = differences(engine, prompts, params, [1, 5], max_prefill_tokens=16, overlap=False)
    assert (differ, other_tokens) == (0, []), f"{differ} of {total} positions differ; tokens differ: {other_tokens}"


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-gemma3"])
def test_moe_and_sliding_window_models(engines, model):
    """An MoE's expert GEMMs (as many rows as the batch routes to the expert) and Gemma's sliding windows."""
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 40000) for _ in range(rng.randint(1, 60))] for _ in range(10)]
    params = [_params(rng) for _ in prompts]
    differ, total, other_tokens = differences(engines.get(model, batch_invariant=True, max_running_req=8), prompts,
                                              params, max_prefill_tokens=64)
    assert (differ, other_tokens) == (0, []), f"{differ} of {total} positions differ; tokens differ: {other_tokens}"


def test_the_torch_attention_is_not_batch_invariant(engines):
    """The comparison above is not vacuous: out of the mode, the torch backend's logits follow the batch (attention
    padded to the batch's longest request). The CPU's default kernel attends each request over its own keys, so on
    tiny-qwen3's shapes, where oneDNN's GEMM rows do not follow M either, the default mode shows no variance here."""
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 40000) for _ in range(rng.randint(3, 60))] for _ in range(12)]
    params = [SamplingParams(max_tokens=8, ignore_eos=True)] * len(prompts)
    differ, total, _ = differences(engines.get("tiny-qwen3", max_running_req=16, attention_backend="torch"), prompts,
                                   params)
    assert differ > total // 10, f"only {differ} of {total} positions differ from the requests alone"


def test_a_prompt_joining_a_chunk_samples_its_own_token(engines):
    """A step may carry a chunk of a long prompt (not its last) and whole prompts: each whole prompt gets its own
    first token, not the chunk's discarded draw (the fuzzer's batch-invariant check found the driver handing the
    step's first sampled tokens to its members in order, the chunk's among them). Request 0 decodes, request 1's
    prompt of 20 tokens is cut into chunks of 3 while it does, request 2 joins the step of request 1's first chunk."""
    engine = engines.get("tiny-qwen3", batch_invariant=True, max_running_req=8)
    prompts = [[11, 12], list(range(100, 120)), [7, 8]]
    params = [SamplingParams(max_tokens=6, ignore_eos=True)] * 3
    differ, total, other_tokens = differences(engine, prompts, params, max_prefill_tokens=8, decode_chunk_tokens=3)
    assert (differ, other_tokens) == (0, []), f"{differ} of {total} positions differ; tokens differ: {other_tokens}"


# ---------------------------------------------------------------------------------------------- the fuzzer
@pytest.mark.parametrize("fault", ["gemm-chosen-by-m", "attention-split-by-batch"])
def test_the_fuzzer_finds_the_modes_planted_faults(engines, fault, tmp_path):
    engines.close()  # the fuzzer's engine under test is this process's
    evaluator = Evaluator("tiny-qwen3", "cpu")
    try:
        with planted(fault):
            result = fuzz(FuzzOptions(budget=60, seed=0, planted=fault, batch_invariant=True, folder=tmp_path),
                          evaluator)
    finally:
        evaluator.close()
    assert result.case is not None, f"the planted fault {fault} was not found"
    assert result.case.failure.invariant == "batch-invariant", failure_text(result.case, result.case_path)
    assert result.counts["positions compared alone, bitwise"] > 0


# ---------------------------------------------------------------------------------------------- parity
def test_parity_passes_on_every_path_in_the_mode(engines, tmp_path):
    """The HF gate in the mode (an MoE: the router and the experts' GEMMs too); every other golden model's run is in
    docs/batch-invariant.md (`python -m harness parity --batch-invariant`)."""
    from harness.parity.run import run_parity

    engines.close()  # the gate builds an engine per path
    result = run_parity("tiny-qwen3-moe", "cpu", "float32", batch_invariant=True, obtained_root=tmp_path)
    assert result.passed, result.failure
    assert {p.path for p in result.paths} >= {"batch", "single", "paged", "prefix", "continuous", "chunked", "free"}


# ---------------------------------------------------------------------------------------------- the bench's measure
def test_the_bench_sees_the_torch_attentions_variance_and_none_in_the_mode(engines):
    """bench --batch-invariant's measure (harness.bench.invariance.batch_variance) on a small batch of its prompts:
    the torch backend's padded attention out of the mode varies, the mode does not."""
    from transformers import AutoTokenizer

    prompts = real_prompts(AutoTokenizer.from_pretrained(zoo.prepare("smollm2-135m")))
    assert len(prompts) == 32 and all(32 <= len(p) <= 96 for p in prompts) and len({tuple(p) for p in prompts}) == 32
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    default = batch_variance(Driver(engines.get("tiny-qwen3", max_running_req=8, attention_backend="torch")),
                             prompts[:8], params)
    invariant = batch_variance(Driver(engines.get("tiny-qwen3", batch_invariant=True, max_running_req=8)),
                               prompts[:8], params)
    assert default["positions_differing"] > 0, default
    assert (invariant["requests_changed"], invariant["positions_differing"]) == (0, 0), invariant
