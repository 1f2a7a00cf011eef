"""Prefill and extend under CUDA graphs equal the eager forward bit for bit: the logits at every prompt position and
the KV written into the pool, for single prompts at and between the token buckets, batches of several requests, an
extend over a cached prefix, pages of 16 tokens, and each head size (64, 128, 256, the last with sliding windows).
The captures' memory stays within what the memory plan reserved for them. Skipped without CUDA."""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch

from engine import Engine, EngineConfig
from engine.core import SamplingParams
from engine.distributed import DistributedInfo
from harness import zoo
from harness.driver import Driver

pytestmark = pytest.mark.cuda
BOUND = 512  # buckets 128, 256, 512


def make(model: str, prefill_graph_tokens: int, **kw) -> Engine:
    zoo.prepare(model)
    kw.setdefault("page_size", 1)
    kw.setdefault("num_page_override", 4096)
    return Engine(EngineConfig(model_path=str(zoo.path(model)), tp_info=DistributedInfo(0, 1), device="cuda",
                               dtype=torch.bfloat16, max_seq_len_override=1024,
                               max_running_req=8, cuda_graph_max_bs=0, prefill_graph_tokens=prefill_graph_tokens,
                               use_dummy_weight=not zoo.MODELS[model].has_weights, **kw))


def prefill(engine: Engine, prompts: List[List[int]], prefix_lens: List[int] | None,
            kv: bool = True) -> Tuple[Dict, torch.Tensor | None, List[bool]]:
    """(log-probabilities at every prompt position, a copy of the pool without the dummy page (kv=False: None, for
    an engine whose pool fills the GPU), for each prefill graph replay whether its attention read the step's own K
    and V)."""
    seen: Dict = {}
    replays: List[bool] = []
    runner_replay = engine.graph_runner.replay

    def counted(batch):
        if batch.is_prefill:
            replays.append(engine.attn_backend.own_kv(batch))
        return runner_replay(batch)

    def hook(uid: int, pos: int, lp: torch.Tensor) -> None:
        for i in range(lp.shape[0]):
            seen[(uid, pos + i)] = lp[i].cpu()

    engine.graph_runner.replay = counted
    try:
        Driver(engine).generate(prompts, SamplingParams(max_tokens=1), prefix_lens=prefix_lens, on_logits=hook)
    finally:
        del engine.graph_runner.replay
    torch.cuda.synchronize()
    return seen, engine.kv_cache._kv[:, :, : engine.num_pages].clone() if kv else None, replays


def prompts_of(lengths: List[int]) -> List[List[int]]:
    return [[(37 * i + 11 * j) % 900 + 20 for j in range(n)] for i, n in enumerate(lengths)]


CASES = {  # name -> (prompt lengths, prefix lengths or None, page size)
    "one bucket exactly": ([128], None, 1),
    "padded to the next bucket": ([129], None, 1),
    "short prompt": ([5], None, 1),
    "single token (the skinny GEMM eagerly)": ([1], None, 1),
    "an extend of 3 tokens": ([40], [37], 1),
    "three requests in one batch": ([40, 7, 300], None, 1),
    "extend over a cached prefix": ([200, 90], [150, 30], 1),
    "pages of 16, extend over a prefix": ([61, 300], [17, 256], 16),
    "largest bucket": ([BOUND], None, 16),
}


@pytest.mark.parametrize("model", ["tiny-qwen3", "qwen3-0.6b", "tiny-gemma3"])  # head_dim 64, 128, 256 + window
@pytest.mark.parametrize("case", list(CASES))
def test_graph_prefill_equals_eager_prefill(model, case):
    lengths, prefix_lens, page_size = CASES[case]
    prompts = prompts_of(lengths)
    results = []
    for tokens in (0, BOUND):
        eng = make(model, tokens, page_size=page_size)
        ragged = eng.attn_backend.ragged_prefill
        try:
            assert len(eng.graph_runner.prefill_graphs) == (3 * (1 + ragged) if tokens else 0)
            results.append(prefill(eng, prompts, prefix_lens))
        finally:
            eng.shutdown()
    (ref, ref_kv, eager_replays), (got, got_kv, graph_replays) = results
    # the prompts (and a prefix's own prefill) through the ragged kernel where the backend has it, extends paged
    assert eager_replays == [] and graph_replays == ([ragged, False] if prefix_lens else [ragged])
    assert ref.keys() == got.keys()
    worst = max((ref[k].float() - got[k].float()).abs().max().item() for k in ref)
    kv_equal = torch.equal(ref_kv, got_kv)
    print(f"{model} {case}: max |graph - eager| logprob {worst:.3g}, KV pool equal: {kv_equal}")
    assert worst == 0.0 and kv_equal


def test_captures_fit_the_reserve_and_the_driver_uses_them():
    """The default engine on CUDA: prefill graphs up to 4096 tokens beside the decode graphs, their memory within
    the plan's graph term, and a one-request prefill replays one."""
    zoo.prepare("qwen3-0.6b")
    eng = Engine(EngineConfig(model_path=str(zoo.path("qwen3-0.6b")), tp_info=DistributedInfo(0, 1), device="cuda",
                              dtype=torch.bfloat16, use_dummy_weight=True, max_seq_len_override=8192,
                              num_page_override=None))
    try:
        runner = eng.graph_runner
        assert sorted({t for t, _ in runner.prefill_graphs}) == [128, 256, 512, 1024, 2048, 4096] and runner.graphs
        print(f"graphs took {runner.memory_used / 2**20:.1f} MiB, reserved for them {eng.reserve.graphs / 2**20:.1f}"
              f" MiB (activations {eng.reserve.activations / 2**20:.1f} MiB)")
        assert 0 < runner.memory_used <= eng.reserve.graphs
        _, _, replays = prefill(eng, prompts_of([1000]), None, kv=False)
        assert len(replays) == 1
    finally:
        eng.shutdown()


def test_a_pool_smaller_than_the_largest_bucket_caps_the_buckets():
    """A KV pool of 64 tokens makes page-table rows of 64 slots: the padding entry's tokens sit at positions 0, 1, ...
    of a row, so no bucket may exceed it (a 1024-token bucket once indexed past the row while capturing)."""
    small = make("tiny-qwen3", 1024, num_page_override=64)
    try:
        assert sorted({t for t, _ in small.graph_runner.prefill_graphs}) == [64]
        got, got_kv, replays = prefill(small, prompts_of([30, 20]), None)
    finally:
        small.shutdown()
    eager = make("tiny-qwen3", 0, num_page_override=64)
    try:
        ref, ref_kv, _ = prefill(eager, prompts_of([30, 20]), None)
    finally:
        eager.shutdown()
    assert len(replays) == 1 and ref.keys() == got.keys()
    assert all(torch.equal(ref[k], got[k]) for k in ref) and torch.equal(ref_kv, got_kv)
