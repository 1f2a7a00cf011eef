"""Determinism: one seed, the same sampled tokens from run to run (on CUDA: tests/test_cuda.py)."""

from __future__ import annotations

import torch

from engine import Engine, EngineConfig
from engine.core import SamplingParams
from engine.distributed import DistributedInfo
from harness import zoo
from harness.driver import Driver

PROMPTS = [[1, 2, 3], [5] * 17, [7, 8]]


def test_same_seed_same_sampled_tokens_run_to_run():
    """Two engines with one seed sample the same tokens; another seed samples others."""
    params = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.7, min_p=0.05, max_tokens=10, ignore_eos=True)]
    runs = []
    for seed in (7, 7, 8):
        eng = Engine(EngineConfig(model_path=str(zoo.path("tiny-qwen3")), tp_info=DistributedInfo(0, 1),
                                  dtype=torch.float32, device="cpu", num_page_override=256, max_seq_len_override=128,
                                  seed=seed))
        runs.append([r.output_ids for r in Driver(eng).generate(PROMPTS, params)])
        eng.shutdown()
    assert runs[0] == runs[1] and runs[0] != runs[2]
