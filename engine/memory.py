"""Memory planning: how many KV pages fit, and how much the forward passes need beside them."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from engine.core import Batch, Req, SamplingParams, get_global_ctx
from engine.sample import Sampler
from engine.utils.misc import align_up, gib

if TYPE_CHECKING:
    from engine.attention.base import AttentionBackend
    from engine.config import EngineConfig
    from engine.kvcache import KVCachePool

logger = logging.getLogger(__name__)


@dataclass
class MemoryPlan:
    init_free: int  # free before the model was loaded
    model: int  # what loading the model took
    reserve: int  # measured peak of activations, workspaces, graphs and logits
    bytes_per_page: int
    num_pages: int
    capped_by: str  # what bound the pool: "memory_ratio", "cpu_kv_cache_bytes" or "num_page_override"

    def describe(self, page_size: int) -> str:
        return (f"KV cache: {self.num_pages} pages x {page_size} = {self.num_pages * page_size} tokens, "
                f"{gib(self.num_pages * self.bytes_per_page)} (free before load {gib(self.init_free)}, "
                f"model {gib(self.model)}, activation reserve {gib(self.reserve)}, bound by {self.capped_by})")


def plan_num_pages(init_free_memory: int, free_memory_now: int, bytes_per_page: int, memory_ratio: float,
                   cpu_cap: int | None, reserve: int, num_page_override: int | None) -> MemoryPlan:
    """usable = memory_ratio x free-before-load - what the model took - the measured reserve (capped on a CPU)."""
    model = max(init_free_memory - free_memory_now, 0)
    if num_page_override is not None:
        num_pages, bound = num_page_override, "num_page_override"
    else:
        available = int(memory_ratio * init_free_memory) - model - reserve
        bound = "memory_ratio"
        if cpu_cap is not None and cpu_cap < available:
            available, bound = cpu_cap, "cpu_kv_cache_bytes"
        num_pages = max(available, 0) // bytes_per_page
    if num_pages <= 1:
        raise ValueError(
            f"not enough memory for the KV cache: {num_pages} page(s) of {bytes_per_page} bytes "
            f"(free before load {gib(init_free_memory)}, model {gib(model)}, reserve {gib(reserve)}); "
            "raise memory_ratio or num_page_override, or use a smaller model, dtype or max_running_req")
    return MemoryPlan(init_free_memory, model, reserve, bytes_per_page, num_pages, bound)


@torch.inference_mode()
def measure_activation_peak(model: torch.nn.Module, config: EngineConfig, make_kv_pool: Callable[[int], KVCachePool],
                            make_attn_backend: Callable[[], AttentionBackend]) -> int:
    """Bytes the forward passes need beside weights and KV pool, measured on CUDA before the pool exists.

    On a scratch pool just large enough (make_kv_pool(pages), with the backend make_attn_backend() over it, both
    installed in the global Context for the probe), run the model's largest prefill (max_forward_len tokens), the
    largest decode batch (its activations are what a CUDA graph's private pool keeps), and the sampler's worst path
    over max_running_req rows; add the attention workspace. The sum is reserved from the KV pool's share.
    """
    ctx, mc, device = get_global_ctx(), config.model_config, torch.device(config.device)
    tokens = config.max_forward_len
    max_bs = max(config.cuda_graph_bs or [1])
    pages = -(-tokens // config.page_size) + max_bs + 1
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    ctx.kv_cache = make_kv_pool(pages)
    ctx.page_table = torch.arange(align_up(tokens, 32), dtype=torch.int32, device=device).repeat(max_bs + 1, 1)
    ctx.attn_backend = attn_backend = make_attn_backend()
    scratch = torch.cuda.memory_allocated(device) - base
    torch.cuda.reset_peak_memory_stats(device)
    try:
        probes = [("prefill", [Req(torch.zeros(tokens, dtype=torch.int32), 0, 0, 1, 0, SamplingParams(), None)]),
                  ("decode", [Req(torch.zeros(2, dtype=torch.int32), i, 1, 1, i, SamplingParams(), None)
                              for i in range(max_bs)])]
        for phase, reqs in probes:
            batch = Batch(reqs=reqs, phase=phase)  # type: ignore[arg-type]
            batch.padded_reqs = reqs
            n = sum(r.extend_len for r in reqs)
            batch.input_ids = torch.zeros(n, dtype=torch.int32, device=device)
            batch.positions = torch.zeros(n, dtype=torch.int32, device=device)
            batch.out_loc = torch.arange(n, dtype=torch.int64, device=device)
            attn_backend.prepare_metadata(batch)
            with ctx.forward_batch(batch):
                model.forward()
        rows = config.max_running_req
        logits = torch.randn(rows, mc.vocab_size, device=device)
        worst = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05)  # min_p forces the sort path
        batch = Batch(reqs=[Req(torch.zeros(1, dtype=torch.int32), 0, 0, 1, 0, worst, None)] * rows, phase="decode")
        sampler = Sampler(device, mc.vocab_size)
        sampler.sample(logits, sampler.prepare(batch))
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base - scratch
    finally:
        ctx.kv_cache = ctx.page_table = ctx.attn_backend = attn_backend = None
        torch.cuda.empty_cache()
    from engine.attention.flashinfer_backend import WORKSPACE_BYTES

    reserve = peak + (WORKSPACE_BYTES if config.attention_backend == "flashinfer" else 0)
    logger.info("measured activation peak %s (prefill of %d tokens, decode of %d, sampling %d rows); reserve %s",
                gib(peak), tokens, max_bs, rows, gib(reserve))
    return reserve
