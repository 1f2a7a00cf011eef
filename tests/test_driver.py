"""The driver: slots, pages, EOS, continuous batching, and the pool whole afterwards."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine import Engine, EngineConfig
from engine.core import SamplingParams
from engine.distributed import DistributedInfo
from harness import zoo
from harness.driver import Driver, PageAllocator, eos_token_ids

PROMPTS = [[1, 2, 3], [5] * 17, [7, 8], list(range(100, 140)), [42]]


@pytest.fixture(scope="module")
def engine():
    eng = Engine(EngineConfig(model_path=str(zoo.path("tiny-qwen3")), tp_info=DistributedInfo(0, 1),
                              dtype=torch.float32, device="cpu", page_size=4, max_running_req=2,
                              num_page_override=64, max_seq_len_override=128))
    yield eng
    eng.shutdown()


def test_continuous_batching_equals_one_batch(engine):
    """2 slots, a 20-token prefill budget: requests queue, join mid-decode and leave; results match a big batch."""
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    queued = Driver(engine, max_prefill_tokens=20).generate(PROMPTS, params)
    alone = [Driver(engine).generate([p], params)[0] for p in PROMPTS]
    assert [r.output_ids for r in queued] == [r.output_ids for r in alone]
    assert all(len(r.output_ids) == 9 and r.finish_reason == "length" for r in queued)


def test_finishes_at_any_of_several_eos_ids(engine):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    free = Driver(engine).generate(PROMPTS, params)
    # make the 4th generated token of each request an EOS id, and another request's 2nd token a second EOS id
    eos = [free[0].output_ids[3], free[1].output_ids[1]]
    out = Driver(engine).generate(PROMPTS, SamplingParams(max_tokens=12), eos_ids=eos)
    for r, f in zip(out, free):
        stop = next((i for i, t in enumerate(f.output_ids) if t in eos), None)
        if stop is None:
            assert r.finish_reason == "length" and r.output_ids == f.output_ids
        else:
            assert r.finish_reason == "eos" and r.output_ids == f.output_ids[: stop + 1]
    assert out[0].finish_reason == out[1].finish_reason == "eos"


def test_ignore_eos_runs_to_max_tokens(engine):
    free = Driver(engine).generate(PROMPTS[:1], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    out = Driver(engine).generate(PROMPTS[:1], SamplingParams(max_tokens=6, ignore_eos=True),
                                  eos_ids=[free.output_ids[0]])[0]
    assert out.output_ids == free.output_ids and out.finish_reason == "length"


def test_pages_are_returned(engine):
    driver = Driver(engine)
    driver.generate(PROMPTS, SamplingParams(max_tokens=5))
    assert sorted(driver.pages.free_pages) == list(range(engine.num_pages))
    assert len(driver.free_rows) == engine.config.max_running_req and not driver.row_pages


class AllocatorMachine(RuleBasedStateMachine):
    """PageAllocator under any interleaving of allocations, frees, double frees and leak checks, against a model of
    which pages are held: pages are never handed out twice while held, and check_no_leak passes exactly when
    nothing is held and nothing was freed twice."""

    def __init__(self) -> None:
        super().__init__()
        self.num = 12
        self.pages = PageAllocator(self.num)
        self.holders: list = []  # each allocation still held, as the allocator handed it out
        self.freed: list = []  # allocations given back (a second free of one is a double free)
        self.double = False

    @rule(n=st.integers(0, 5))
    def alloc(self, n):
        if n <= len(self.pages.free_pages) and not self.double:
            got = self.pages.alloc(n)
            held = {p for h in self.holders for p in h}
            assert not held & set(got) and len(set(got)) == n
            if len(got):
                self.holders.append(got)

    @precondition(lambda self: self.holders)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        got = self.holders.pop(i % len(self.holders))
        self.pages.free(got)
        self.freed.append(got)

    @precondition(lambda self: any(len(g) for g in self.freed))
    @rule(i=st.integers(0, 100))
    def free_twice(self, i):
        again = [g for g in self.freed if len(g)][i % len([g for g in self.freed if len(g)])]
        self.pages.free(again)
        self.double = True

    @rule()
    def check(self):
        if self.holders or self.double:
            with pytest.raises(AssertionError, match="leaked or freed twice"):
                self.pages.check_no_leak()
        else:
            self.pages.check_no_leak()

    @invariant()
    def counts_add_up(self):
        if not self.double:
            assert len(self.pages.free_pages) + sum(map(len, self.holders)) == self.num


TestPageAllocator = AllocatorMachine.TestCase
TestPageAllocator.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_forced_tokens_are_fed_back(engine):
    forced = [[11, 12, 13, 14]]
    seen = {}
    Driver(engine).generate([[1, 2, 3]], SamplingParams(max_tokens=4), forced=forced,
                            on_logits=lambda uid, pos, lp: seen.update({pos + i: lp[i] for i in range(len(lp))}))
    assert sorted(seen) == [0, 1, 2, 3, 4, 5]  # 3 prefill positions, then decode after 11, 12, 13


def test_eos_ids_from_generation_config():
    assert eos_token_ids(zoo.path("smollm2-135m")) == [2]


def test_overlap_wastes_at_most_one_step_per_eos(engine):
    """A request that stops at EOS was already scheduled into the next step: that one step is all it costs."""
    params = SamplingParams(max_tokens=12)
    free = Driver(engine, overlap=False).generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    eos = [free[1].output_ids[2]]
    runs = {}
    for overlap in (False, True):
        driver = Driver(engine, overlap=overlap)
        out = driver.generate(PROMPTS, params, eos_ids=eos)
        runs[overlap] = (out, sum(s.batch_size for s in driver.steps if s.phase == "decode"))
    stopped = sum(r.finish_reason == "eos" for r in runs[False][0])
    assert stopped >= 1 and [r.output_ids for r in runs[True][0]] == [r.output_ids for r in runs[False][0]]
    assert 0 <= runs[True][1] - runs[False][1] <= stopped

