"""The bench's floor: a prefill's LM head runs on its last token only, so its FLOPs are counted once a request
(counted for every prompt token, gemma3-270m's 512-token CPU prefill ran at 2.22 times its floor)."""

from __future__ import annotations

import torch

from engine import Engine, EngineConfig
from engine.distributed import DistributedInfo
from harness import zoo
from harness.bench.limits import model_cost


def test_a_prefill_counts_the_lm_head_once_a_request() -> None:
    engine = Engine(EngineConfig(model_path=str(zoo.path("tiny-qwen3")), tp_info=DistributedInfo(0, 1),
                                 dtype=torch.float32, device="cpu", num_page_override=64, max_seq_len_override=64))
    try:
        cost = model_cost(engine)
        mc = engine.config.model_config
        params = sum(p.numel() for p in engine.model.parameters())
    finally:
        engine.shutdown()
    head = mc.vocab_size * mc.hidden_size  # tied: the embedding is the head
    assert cost.head_flops_per_row == 2 * head
    assert cost.flops_per_token == 2 * (params - head)
    n = 32
    decode, prefill = cost.forward(n, 0, 0)[1], cost.forward(n, 0, 0, rows=1)[1]
    assert decode == 2 * params * n  # a decode batch of n requests: n rows of logits
    assert decode - prefill == 2 * head * (n - 1)

