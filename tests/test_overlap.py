"""Overlap scheduling gives the tokens the simple loop gives: greedy with EOS, seeded sampling, two page sizes."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig
from engine.core import SamplingParams
from engine.distributed import DistributedInfo
from harness import zoo
from harness.driver import Driver

OVERLAP_PROMPTS = [[3, 14, 15, 92, 65], [35] * 11, list(range(800, 833)), [27, 18, 28], list(range(40, 47)) * 3,
                   [99, 98, 97, 96]]


@pytest.mark.parametrize("page_size", [1, 3])
def test_overlap_and_simple_loops_give_the_same_tokens(page_size):
    """Greedy with EOS (requests stop early and others take their slots), and seeded sampling: the overlap loop
    and the simple loop produce the same tokens; pages come back in both."""
    eng = Engine(EngineConfig(model_path=str(zoo.path("tiny-qwen3")), tp_info=DistributedInfo(0, 1),
                              dtype=torch.float32, device="cpu", page_size=page_size, max_running_req=3,
                              num_page_override=256, max_seq_len_override=128))
    try:
        greedy = SamplingParams(max_tokens=10)
        free = Driver(eng, overlap=False).generate(OVERLAP_PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True))
        eos = [free[0].output_ids[2], free[3].output_ids[5]]  # two requests stop early
        sampled = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=8 + i % 3, seed=None if i % 2 else i)
                   for i in range(len(OVERLAP_PROMPTS))]
        for params, stop in ((greedy, eos), (sampled, eos), (sampled, ())):
            simple = Driver(eng, overlap=False, max_prefill_tokens=40).generate(OVERLAP_PROMPTS, params, eos_ids=stop)
            overlap = Driver(eng, overlap=True, max_prefill_tokens=40).generate(OVERLAP_PROMPTS, params, eos_ids=stop)
            assert [r.output_ids for r in overlap] == [r.output_ids for r in simple]
            assert [r.finish_reason for r in overlap] == [r.finish_reason for r in simple]
        assert {r.finish_reason for r in simple} <= {"length", "eos"}
    finally:
        eng.shutdown()
